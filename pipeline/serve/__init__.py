"""`pipeline serve`'s HTTP front-end, above the scheduler (the command itself: commands/serve.py).

protocol.py     the OpenAI wire format: request schemas, response and chunk bodies, error bodies
limits.py       how much of a request is read: the body's cap (413), refused before the rest arrives
prompts.py      a request's prompt as token ids (chat template, context check), in the HTTP threads
gateway.py      the hand-off to the scheduler's thread (its QueueSource) and back; capacity, draining
adapters.py     engine events (Tokens, Finished) as chunks of a stream or one response body
responses_protocol.py, responses_adapter.py, responses_store.py
                OpenAI's Responses API (/v1/responses): its schema and items as chat messages; its
                adapter and events; the responses kept for GET, DELETE and previous_response_id
chat_output.py  whether a request's tools can go to this model; chat/'s parser events as chunk deltas
metrics.py      GET /metrics (prometheus-client)
app.py          the routes (Starlette), run by uvicorn in a thread of rank 0
server.py       that thread's start and stop: the socket, uvicorn, draining on SIGTERM or SIGINT
static/         the chat page
"""
