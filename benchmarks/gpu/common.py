"""Shared by the GPU scripts: the environment record (one implementation, linattn.bench.env) and JSON writing."""
import json
import os


def env_line() -> dict:
    """The environment dict of linattn.bench.env with its one-line summary under "line"."""
    import torch

    from linattn.bench.env import collect_env, env_line as line
    env = collect_env("cuda" if torch.cuda.is_available() else "cpu")
    env["line"] = line(env)
    return env


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
