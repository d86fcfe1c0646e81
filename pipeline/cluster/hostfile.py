"""MPI hostfiles: one host per line, in either launcher's dialect.

    # Open MPI                      # MPICH (Hydra)
    studio-1 slots=1                studio-1:1
    10.0.5.2 slots=1 max_slots=1    10.0.5.2:1

A bare host name means one slot. `#` starts a comment. The launcher (launch/run.py) reads
either dialect and writes the one the installed MPI wants, so one file serves both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..util.errors import UserError

_HOST = r"[A-Za-z0-9_.\-]+"  # host name, IPv4 address
_OPENMPI = re.compile(rf"^(?P<host>{_HOST})((?:\s+\w+\s*=\s*\S+)*)$")
_MPICH = re.compile(rf"^(?P<host>{_HOST}):(?P<slots>\S+)$")
_KEY_VALUE = re.compile(r"(\w+)\s*=\s*(\S+)")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int  # 1-based line number in the file


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """Hosts in file order. Raises UserError naming the file and line of the first mistake."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        mpich = _MPICH.match(line)
        openmpi = _OPENMPI.match(line)
        if mpich:
            name, slots_text = mpich["host"], mpich["slots"]
        elif openmpi:
            name = openmpi["host"]
            settings = dict(_KEY_VALUE.findall(openmpi.group(2)))
            unknown = set(settings) - {"slots", "max_slots", "max-slots"}
            if unknown:
                raise UserError(f"{where}: unknown setting {sorted(unknown)[0]!r} in {raw.strip()!r} "
                                f"(expected 'HOST slots=N' or 'HOST:N')")
            slots_text = settings.get("slots", "1")
        else:
            raise UserError(f"{where}: cannot read {raw.strip()!r}: expected 'HOST slots=N' (Open MPI) "
                            f"or 'HOST:N' (MPICH)")
        try:
            slots = int(slots_text)
        except ValueError:
            slots = 0
        if slots < 1:
            raise UserError(f"{where}: slots must be a whole number >= 1, got {slots_text!r}")
        if name in seen:
            raise UserError(f"{where}: host {name} is listed twice (also on line {seen[name]}): "
                            f"give it one line with slots=N instead")
        seen[name] = number
        hosts.append(Host(name, slots, number))
    if not hosts:
        raise UserError(f"{source}: no hosts in it")
    return hosts


def read_hostfile(path: Path | str) -> list[Host]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"hostfile {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read hostfile {path}: {e}") from None
    return parse_hostfile(text, str(path))


def check_slots(hosts: list[Host], ranks: int, source: str = "the hostfile") -> None:
    total = sum(h.slots for h in hosts)
    if total < ranks:
        raise UserError(f"{source} has {total} slot{'s' if total != 1 else ''} on {len(hosts)} "
                        f"host{'s' if len(hosts) != 1 else ''} but the job needs {ranks} ranks: "
                        f"add hosts or slots, or run fewer ranks")


def format_hostfile(hosts: list[Host], flavor: str) -> str:
    """The hostfile in the dialect of `flavor` ("openmpi" or "mpich")."""
    if flavor == "openmpi":
        return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
    if flavor == "mpich":
        return "".join(f"{h.name}:{h.slots}\n" for h in hosts)
    raise ValueError(flavor)
