"""A torchrun worker for tests/test_torch_elastic.py's scenarios, without torch
(it starts in milliseconds): prints one JSON line of what its agent told it
(RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, the restart count,
its pid), writes the same to OUT_DIR/RANK.json with --out-dir, and with
--stop-file runs until that file exists (failing after --hold seconds)."""

import argparse
import json
import os
import sys

KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir")
    parser.add_argument("--stop-file")
    parser.add_argument("--hold", type=float, default=60.0)
    args = parser.parse_args()
    env = {k: os.environ.get(k) for k in KEYS}
    env["pid"] = os.getpid()
    line = json.dumps(env)
    if args.out_dir:
        with open(os.path.join(args.out_dir, f"{env['RANK']}.json"), "w") as f:
            f.write(line)
    print(line, flush=True)
    if args.stop_file:
        from waiting import wait_until  # tests/waiting.py, beside this script: imported once the line is out

        wait_until(lambda: os.path.exists(args.stop_file), args.hold, f"{args.stop_file} to exist", interval_s=0.05)
    sys.exit(0)


if __name__ == "__main__":
    main()
