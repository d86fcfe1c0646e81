"""`batch`: a JSONL file of requests in, JSONL results out, every rank busy (see scheduler.py);
resumable. The files themselves are batch_io.py's."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from . import flags
from ..cluster import mpi
from ..runtime.settings import RingSettings
from ..util.errors import UserError
from .batch_io import InputRequest, ResultsFile, error_record, note, read_requests, result_record


def add_parser(commands) -> None:
    batch = commands.add_parser(
        "batch", help="run a JSONL file of requests with every rank busy; resumable",
        description="Run with `mpiexec -n N python -m pipeline batch --input IN.jsonl --output OUT.jsonl`. "
                    "Requests are decoded together in micro-batches that flow through the ranks one after "
                    "another, so every rank works at once; a finished sequence's place goes to the next "
                    "request. Each result is appended to --output (and fsync'd) as it finishes; rerunning "
                    "the same command skips the ids already there.")
    batch.add_argument("--input", type=Path, required=True,
                       help='JSONL requests: {"id", "prompt" or "messages", optional max_tokens, temperature, '
                            'top_p, top_k, min_p, repetition_penalty, seed, stop, system}, or OpenAI Batch '
                            'lines {"custom_id", "body": {...}}')
    batch.add_argument("--output", type=Path, required=True, help="JSONL results, appended (and resumed from)")
    flags.add_model_arg(batch)
    flags.add_engine_args(batch)
    flags.add_prefix_cache_arg(batch, default_gb=RingSettings.prefix_cache_gb)
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
    batch.add_argument("--trace", type=Path, default=None, metavar="FILE",
                       help="write a Chrome trace-event JSON of every rank's compute, receive and send spans "
                            "(open it in https://ui.perfetto.dev)")
    flags.add_sampling_args(batch, per_request=True)
    flags.add_draft_args(batch)
    batch.add_argument("--system", default=None, help="system message for requests given as a 'prompt'")
    batch.add_argument("--no-chat-template", action="store_true", help="feed 'prompt' requests as raw text")
    flags.add_weights_args(batch)
    flags.add_cluster_args(batch, transports=False)
    flags.add_tensor_parallel_arg(batch)


def validate(args: argparse.Namespace) -> None:
    flags.validated_scheduler_job_args(args)
    flags.validated_tensor_parallel_arg(args)


def check_paths(args: argparse.Namespace) -> None:
    """Rank 0: the input exists and the output is another file in an existing folder."""
    if args.input.is_dir():
        raise UserError(f"the input {args.input} is a folder: give the JSONL file of requests")
    if not args.input.is_file():
        raise UserError(f"input file {args.input} does not exist on {socket.gethostname()}")
    if args.output.is_dir():
        raise UserError(f"the output {args.output} is a folder: give the JSONL file for the results")
    if args.output.exists() and args.output.resolve() == args.input.resolve():
        raise UserError("--output is the --input file: results go to a file of their own")
    if not args.output.resolve().parent.is_dir():
        raise UserError(f"the folder of --output {args.output} does not exist")
    if args.trace is not None and not args.trace.resolve().parent.is_dir():
        raise UserError(f"the folder of --trace {args.trace} does not exist")


def engine_requests(todo: list[InputRequest], tokenizer, use_chat_template: bool, context: int, record):
    """The scheduler's requests, each tokenized only when the scheduler has room for it; a line
    that cannot be tokenized gets its error record instead. record(dict, error: bool) writes one."""
    # Here, not at the top: cli imports every command's module to build its parser (start-up time).
    from ..chat.reasoning import prompt_opens_reasoning, split_reasoning, template_thinks
    from ..runtime.requests import Failed, Finished, Request

    thinks = template_thinks(tokenizer.chat_template)

    def handler(item: InputRequest, in_reasoning: bool | None):
        def on_event(event) -> None:
            if isinstance(event, Finished):
                entry = result_record(item, event.text, event.reason, event.prompt_tokens, event.completion_tokens,
                                      event.cached_tokens, queued_s=event.queued_s, ttft_s=event.ttft_s,
                                      total_s=event.total_s)
                # A thinking model's record: its thinking in "reasoning", the answer alone in "text"
                reasoning, answer = split_reasoning(event.text, in_reasoning) if in_reasoning is not None else (None, "")
                if reasoning is not None:
                    entry = {"id": entry.pop("id"), "reasoning": reasoning, **entry, "text": answer}
                record(entry, False)
            elif isinstance(event, Failed):
                record(error_record(item.id, item.line, event.message), True)
        return on_event

    for item in todo:
        try:
            ids = prompt_ids(item, tokenizer, use_chat_template, context)
        except UserError as e:
            record(error_record(item.id, item.line, str(e)), True)
            continue
        except Exception as e:  # noqa: BLE001 -- a tokenizer bug on one line fails that line alone
            record(error_record(item.id, item.line, f"could not tokenize: {type(e).__name__}: {e}"), True)
            continue
        chat = item.messages is not None or (use_chat_template and tokenizer.has_chat_template)
        # Where the output starts (inside a thinking block or not) is in the rendered prompt's last tokens
        in_reasoning = prompt_opens_reasoning(tokenizer.decode(ids[-16:])) if chat and thinks else None
        yield Request(ids, item.sampling, item.max_tokens, handler(item, in_reasoning), stop=item.stop, tag=item)


def prompt_ids(item: InputRequest, tokenizer, use_chat_template: bool, context: int) -> list[int]:
    if item.messages is not None:
        ids = tokenizer.encode(tokenizer.apply_chat_template(item.messages), add_special_tokens=False)
    else:
        ids = tokenizer.prompt_ids(item.prompt, system=item.system, use_chat_template=use_chat_template)
    if not ids:
        raise UserError("the prompt is empty")
    if len(ids) >= context:
        raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {context}: shorten it")
    return ids


def run(args: argparse.Namespace, comm) -> int:
    # Here, not at the top: cli imports every command's module to build its parser, and these load MLX,
    # which `pipeline plan` must not (start-up time).
    from ..runtime.job import head_split, load_ring_stage, plan_ring_job, prefix_cache
    from ..runtime.rank_figures import (group_sums_label, head_share_label, matmuls_label, per_rank, rank_figures,
                                        rss_label)
    from ..runtime.requests import ListSource
    from ..runtime.scheduler import Scheduler, follow, stop_followers
    from ..runtime.tensor_group import follow_leader, stop_mates
    from ..checkpoints.tokenizer import Tokenizer
    from ..runtime.trace import Timeline, split_hint, summary_lines, write_chrome_trace

    rank, size = comm.Get_rank(), comm.Get_size()
    settings = flags.job_settings(args)
    job = plan_ring_job(settings, comm)
    transport, plan, group_rows, microbatches = job.transport, job.plan, job.group_rows, job.microbatches

    def prepare():
        """Rank 0, before any weights are read: the input parsed (duplicate ids refused), the
        output locked and repaired, error records for lines that cannot run, what is left."""
        if rank != 0:
            return None
        check_paths(args)
        tokenizer = Tokenizer.from_folder(plan.folder)
        requests, bad = read_requests(args.input, args.sampling, args.max_tokens, args.system)
        results = ResultsFile(args.output)
        if results.repaired:
            note(f"{args.output}: {results.repaired}")
        skipped = sum(1 for r in requests if r.key in results.done)
        skipped += sum(1 for b in bad if b.key in results.done)
        errors = [b for b in bad if b.key not in results.done]
        for b in errors:
            results.write(b.record())
        todo = [r for r in requests if r.key not in results.done]
        if skipped:
            note(f"skipping {skipped} request{'s' if skipped != 1 else ''} already in {args.output}")
        if errors:
            note(f"{len(errors)} input line{'s' if len(errors) != 1 else ''} cannot run: error records written")
        return tokenizer, todo, results, len(errors)

    prepared = mpi.checkpoint(comm, prepare)
    todo_count = comm.bcast(len(prepared[1]) if rank == 0 else None, root=0)
    if todo_count == 0:
        if rank == 0:
            prepared[2].close()
            note(f"nothing to run: every request of {args.input} has a record in {args.output}")
        return 0

    stage = load_ring_stage(settings, job, comm, progress=rank == 0 and not args.quiet)
    timeline = Timeline(rank, keep_spans=args.trace is not None)
    comm.Barrier()
    timeline.restart()
    stats = None
    if rank == 0:
        from tqdm import tqdm  # here, not at the top: slow to import (start-up time, as above)

        tokenizer, todo, results, _ = prepared
        progress = tqdm(total=todo_count, unit="req", desc="batch", file=sys.stderr, disable=args.quiet,
                        dynamic_ncols=True)
        def record(entry: dict, error: bool) -> None:
            results.write(entry)
            progress.update(1)

        written_before = results.count  # the error records of lines that cannot run
        requests = engine_requests(todo, tokenizer, not args.no_chat_template, plan.config.max_position_embeddings,
                                   record)
        try:
            scheduler = Scheduler(stage, transport, tokenizer, ListSource(requests), max_batch=args.max_batch,
                                  microbatches=microbatches, group_rows=group_rows, timeline=timeline,
                                  head_split=head_split(settings.ring, job),
                                  prefix_cache=prefix_cache(settings, job),
                                  draft=flags.draft_settings(args))
            stats = scheduler.run()
        except KeyboardInterrupt:
            raise mpi.Interrupted(f"interrupted: {results.count - written_before} of {todo_count} requests have "
                                  f"their records in {args.output}; rerun the same command to resume") from None
        finally:  # on an exception, the abort hook ends every rank: no STOP to wait on
            progress.close()
            results.close()
        stop_followers(transport, timeline)
        stop_mates(job.group)
    elif job.group.leads:
        follow(stage, transport, timeline, group_rows)
        stop_mates(job.group)
    else:
        follow_leader(stage, job.group)
    timeline.finish()

    summaries = comm.gather(timeline.summary(), root=0)
    summaries = summaries and summaries[::job.group.size]  # the ring's ranks: the stage leaders
    figures = comm.gather(rank_figures(stage, matmuls=matmuls_label(group_rows),
                                       group_sum_ms=job.group.ms_per_step(stage)), root=0)
    if rank == 0:
        hosts = [f.host for f in figures]
        print(f"[pipeline] batch: {results.count - results.errors} done, {results.errors} error records, "
              f"{stats.generated_tokens} tokens generated in {stats.wall_s:.2f} s: {stats.tokens_per_s:.1f} tok/s "
              f"(prompts {stats.prompt_tokens} tokens; {microbatches} micro-batches, "
              f"max batch {args.max_batch}; matmuls {per_rank([f.matmuls for f in figures])}; layers per rank "
              f"{','.join(str(end - start) for start, end in plan.ranges)}"
              f"{head_share_label(stats.head_share, size)}"
              f"{'; speculative: ' + stats.draft.describe() if stats.draft else ''}); "
              f"weights {per_rank([f.weights for f in figures])}, BLAS {per_rank([f.blas for f in figures])}, "
              f"peak RSS {rss_label(figures, kv_cache=False)}{group_sums_label(figures)}",
              file=sys.stderr)
        for line in summary_lines(summaries, hosts if len(set(hosts)) > 1 else None):
            print(line, file=sys.stderr)
        hint = split_hint(summaries, [end - start for start, end in plan.ranges])
        if hint and stats.wall_s > 5:  # a few seconds of decoding say something; a blip does not
            print(hint, file=sys.stderr)
        sys.stderr.flush()
        if args.trace is not None:
            write_chrome_trace(args.trace, summaries, hosts)
            note(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    return 0
