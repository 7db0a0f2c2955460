"""`sandboxd check`: what will work on this host for a given configuration, and why
not, without changing anything (check/run.py). Its configuration loading (check/config.py)
and directory look (check/dirs.py) also guard the daemon's own start: a bad
configuration is refused, with each field's path and reason, before anything is made."""

from sandboxd.check.config import ConfigError, load_config, render_errors
from sandboxd.check.dirs import dir_findings
from sandboxd.check.run import run_check

__all__ = ["ConfigError", "dir_findings", "load_config", "render_errors", "run_check"]
