"""kvport's records carry their time, in kvport's commands and inside an engine's process."""

from __future__ import annotations

import re
import subprocess
import sys

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} kvport\.engines\.x WARNING loaded 3 pages$")


def _stderr(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return out.stderr.splitlines()


def test_in_an_engine_process_kvport_records_get_a_timestamped_handler_once() -> None:
    # an engine that configured only its own logger: without attach, the record would be the bare message
    lines = _stderr("import logging; from kvport import logs\n"
                    "logging.getLogger('engine').addHandler(logging.StreamHandler())\n"
                    "logs.attach('INFO'); logs.attach('INFO')\n"
                    "logging.getLogger('kvport.engines.x').warning('loaded %d pages', 3)\n"
                    "logging.getLogger('kvport.engines.x').debug('not at INFO')")
    assert len(lines) == 1 and STAMP.match(lines[0]), lines


def test_a_process_that_routes_records_already_keeps_its_own_handler() -> None:
    lines = _stderr("import logging; from kvport import logs\n"
                    "logging.basicConfig(format='ROOT %(message)s')\n"
                    "logs.attach('INFO')\n"
                    "logging.getLogger('kvport.engines.x').warning('loaded %d pages', 3)")
    assert lines == ["ROOT loaded 3 pages"]


def test_kvport_commands_log_with_the_same_format() -> None:
    lines = _stderr("import logging; from kvport import logs\n"
                    "logs.setup('WARNING')\n"
                    "logging.getLogger('kvport.engines.x').warning('loaded %d pages', 3)")
    assert len(lines) == 1 and STAMP.match(lines[0]), lines
