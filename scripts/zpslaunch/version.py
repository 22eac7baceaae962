"""zpslaunch.version - `zps-launch --version`: the same line as the C binaries'
zps_version_line() ("PROG VERSION (git HASH)"), VERSION from common/version.h's ZPS_VERSION
and HASH from the source tree this script lives in (12 hex digits, "-dirty" with local
changes, "unknown" outside git), as the Makefile computes it for the binaries.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def _git(*argv):
    return subprocess.run(["git", "-C", ROOT, *argv], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=10)


def version_line(prog):
    try:
        with open(os.path.join(ROOT, "common", "version.h")) as f:
            m = re.search(r'#define\s+ZPS_VERSION\s+"([^"]*)"', f.read())
        version = m.group(1) if m else "unknown"
    except OSError:
        version = "unknown"
    try:
        r = _git("rev-parse", "--short=12", "HEAD")
        commit = r.stdout.strip() if r.returncode == 0 else ""
        if commit and _git("diff", "--quiet", "HEAD", "--").returncode != 0:
            commit += "-dirty"
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return f"{prog} {version} (git {commit or 'unknown'})"


class VersionAction(argparse.Action):
    """--version: prints the line and exits 0 (git is asked only then)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line(parser.prog), flush=True)
        sys.exit(0)
