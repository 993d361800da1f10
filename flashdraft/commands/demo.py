"""`flashdraft demo`: the whole pipeline on SmolLM2-135M, end to end."""

from __future__ import annotations

import argparse

from flashdraft import demo

add_arguments = demo.add_arguments


def run(args: argparse.Namespace) -> int:
    return demo.run(args)
