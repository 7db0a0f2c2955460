"""`sandboxctl`: run a command in a sandbox, follow and cancel running calls, fetch
artifacts, read traces, explain policies. Exit codes follow `docker run` and `timeout`:
the command's own code, 124 when the timeout killed it, 137 when it was killed for
memory, 125 when sandboxd refused or failed before the command ran.

The commands live by job: cli_exec.py (exec), cli_transfer.py (cp), cli_live.py (ps, logs, cancel, pool),
cli_records.py (artifact, trace, audit, explain), cli_setup.py (context, completion);
cli_parser.py has their arguments, contexts.py where to connect."""

from __future__ import annotations

import os
import sys

import yaml

from .cli_common import EXIT_CANCELLED, EXIT_OOM, EXIT_REFUSED, EXIT_TIMEOUT, exit_code_for, fail, load_policy, shown
from .cli_parser import build_parser
from .cli_records import file_access_line, network_line
from .contexts import ConfigError

# 128 + SIGPIPE, as a command the shell saw die of it.
EXIT_BROKEN_PIPE = 141

__all__ = ["EXIT_CANCELLED", "EXIT_OOM", "EXIT_REFUSED", "EXIT_TIMEOUT", "build_parser", "exit_code_for",
           "file_access_line", "load_policy", "main", "network_line", "shown"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`| head`): nothing to say, as `git log | head`
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except ConfigError as exc:  # where to connect: nothing was sent
        return fail(str(exc))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return fail(str(exc))


def _quiet_stdout() -> None:
    """stdout pointed at /dev/null: Python's flush at exit would meet the broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
