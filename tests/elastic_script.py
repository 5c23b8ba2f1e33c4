#!/usr/bin/env python3
"""PyTorch's test/distributed/launcher/bin/test_script.py (BSD-style licence,
Facebook, Inc. and its affiliates), for tests/test_torch_elastic.py: a worker
script that checks the variables its agent set and touches a file named after
its global rank (or fails, with --fail)."""

import argparse
import os
from pathlib import Path


def parse_args():
    parser = argparse.ArgumentParser(description="test script")
    parser.add_argument("--fail", default=False, action="store_true", help="forces the script to throw a RuntimeError")
    # file is used for assertions
    parser.add_argument("--touch-file-dir", "--touch_file_dir", type=str,
                        help="dir to touch a file with global rank as the filename")
    return parser.parse_args()


def main():
    args = parse_args()
    env_vars = [
        "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "ROLE_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "OMP_NUM_THREADS", "TEST_SENTINEL_PARENT", "TORCHELASTIC_ERROR_FILE",
    ]

    print("Distributed env vars set by agent:")
    for env_var in env_vars:
        value = os.environ[env_var]
        print(f"{env_var} = {value}")

    if args.fail:
        raise RuntimeError("raising exception since --fail flag was set")
    file = os.path.join(args.touch_file_dir, os.environ["RANK"])
    Path(file).touch()
    print(f"Success, created {file}")


if __name__ == "__main__":
    main()
