"""The prompt and rounds of the session's real captures and references (tests/conftest.py):
tests that ask for these share one capture and one reference per fixture variant."""

DEFAULT_TOKENS = "7,21,3,99,140,5,260,33,18,402,77,9"
DEFAULT_ROUNDS = 3
