"""`graphguard` command line: serve | inspect | doctor.

Each subcommand lives in its own module with a `main(argv) -> int`; this file only dispatches,
so `graphguard doctor` never imports the serving stack.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("graphguard.server.cli", "OpenAI-compatible server (embedded SmolLM2 by default)"),
    "inspect": ("graphguard.inspect", "print a graph manifest written by export()"),
    "doctor": ("graphguard.doctor", "check torch, CUDA and a graph capture on this machine"),
}


def usage() -> str:
    lines = ["usage: graphguard <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`graphguard <command> --help` describes a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        from graphguard.version import __version__

        print(f"graphguard {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"graphguard: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(command[0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
