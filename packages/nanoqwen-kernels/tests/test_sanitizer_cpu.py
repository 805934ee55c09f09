"""CPU: the verdict on a compute-sanitizer log (conftest.sanitizer_failure, as a fixture) accepts only
what each tool prints on a clean run: racecheck's summary is "RACECHECK SUMMARY: 0 hazards displayed
(0 errors, 0 warnings)", not memcheck's "ERROR SUMMARY: 0 errors", and a non-zero exit, a missing
summary or any non-zero count fails."""

from __future__ import annotations

import pytest

CLEAN = {
    "memcheck": "========= COMPUTE-SANITIZER\nok\n========= ERROR SUMMARY: 0 errors\n",
    "synccheck": "========= COMPUTE-SANITIZER\nok\n========= ERROR SUMMARY: 0 errors\n",
    "racecheck": "========= COMPUTE-SANITIZER\nok\n"
    "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n",
}


@pytest.mark.parametrize("tool", sorted(CLEAN))
def test_clean_logs_pass(tool, sanitizer_failure):
    assert sanitizer_failure(tool, 0, CLEAN[tool]) is None


def test_racecheck_needs_its_own_summary(sanitizer_failure):
    # what the old check accepted: a racecheck run judged by memcheck's line (absent in racecheck's log)
    assert "no 'RACECHECK SUMMARY" in sanitizer_failure("racecheck", 0, CLEAN["memcheck"])
    hazards = CLEAN["racecheck"].replace("0 hazards displayed (0 errors, 0 warnings)",
                                         "2 hazards displayed (0 errors, 2 warnings)")
    assert "reported" in sanitizer_failure("racecheck", 0, hazards)


def test_failures_are_reported(sanitizer_failure):
    assert "exited with status 3" in sanitizer_failure("memcheck", 3, CLEAN["memcheck"])
    assert "no 'ERROR SUMMARY" in sanitizer_failure("memcheck", 0, "========= COMPUTE-SANITIZER\ncrash\n")
    errors = CLEAN["memcheck"].replace("0 errors", "4 errors")
    assert sanitizer_failure("memcheck", 0, errors) is not None
    leak = CLEAN["memcheck"] + "========= LEAK SUMMARY: 1024 bytes leaked in 1 allocations\n"
    assert "LEAK SUMMARY" in sanitizer_failure("memcheck", 0, leak)
    # racecheck may also print the generic line; a clean one of either kind is fine
    both = CLEAN["racecheck"] + "========= ERROR SUMMARY: 0 errors\n"
    assert sanitizer_failure("racecheck", 0, both) is None
