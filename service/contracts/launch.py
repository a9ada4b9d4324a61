"""How to start an engine process: its command line, the environment it adds to the
parent's, and notes on what was adjusted. Built by the engines' launchers
(``engines/sglang.py``, ``engines/launch.py``), run by the supervisor, printed by
``embedserve engine --dry-run``."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def command_line(self) -> str:
        return shlex.join(self.argv)

    def env_lines(self) -> list[str]:
        return [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
