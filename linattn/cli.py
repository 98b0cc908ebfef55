"""The `linattn` command. Each subcommand lives in linattn/commands/<name>.py and provides
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs."""
import argparse
import importlib
import sys

COMMANDS = {
    "demo": "run the main job: Gated DeltaNet forward checked against the reference, with its time",
    "bench": "same-run timing of an op's backends against peers and the roofline",
    "verify": "run an op's GPU gate, then (only if green) bench its quick preset",
    "doctor": "what this machine is, what Triton and Gluon provide, which backend each op picks and why",
    "inspect": "compile a registered kernel ahead of time (no GPU needed) and report registers, spills, SASS",
    "tune": "measure launch configs on this GPU and write the per-GPU config cache",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="linattn", description="linear-attention kernels for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            mod = importlib.import_module(f"linattn.commands.{name}")
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
    args = parser.parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
