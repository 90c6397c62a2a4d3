"""The ``hf-tapernorm`` command line: argument dataclasses (arguments.py: taper's and eval's; export_arguments.py:
fold's and push's; parsing is hf_tapernorm/_parsing.py), the subcommands (commands.py; ``taper`` is app/taper.py,
``bench`` is bench/) and the dispatcher (main.py)."""

from .main import command, main

taper_command = command("taper")
fold_command = command("fold")
eval_command = command("eval")
push_command = command("push")
bench_command = command("bench")

__all__ = ["bench_command", "eval_command", "fold_command", "main", "push_command", "taper_command"]
