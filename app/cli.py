"""`slimserve` command line: generate | serve | quantize | eval.

Each subcommand lives with the code it drives and registers itself through `COMMANDS`;
modules are imported lazily so `slimserve generate` never imports Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module with add_arguments(parser) and run(args) -> int
COMMANDS = {
    "generate": "app.engine.generate_cli",
    "serve": "app.serve.cli",
    "quantize": "app.quant.quantize_cli",
    "eval": "app.evaluation.eval_cli",
}


def default_model() -> str:
    from app.assets import default_model_path

    return default_model_path()


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="slimserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module_name in COMMANDS.items():
        p = sub.add_parser(name)
        if name != wanted:  # only import what runs
            continue
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            parser.error(f"'{name}' is unavailable: {e}")
        modules[name].add_arguments(p)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, modules = build_parser(argv)
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
