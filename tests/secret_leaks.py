"""A run's program that leaks its secret API_TOKEN every way a log can (the secret-wall tests, local and
through a server): in a 200 KiB line written in 4 KiB parts with the value at the 64 KiB piece cuts and
across them, then in its last error line before it exits 1."""

LEAKY_PROGRAM = """\
import os, sys
tok = os.environ["API_TOKEN"]
print("starting with token " + tok, flush=True)
size = 200 * 1024
line = bytearray(b"-" * size)
for off in (0, 65536 - 7, 131072 - len(tok) // 2, 196608 - 1, size - len(tok)):
    line[off:off + len(tok)] = tok.encode()
for start in range(0, size, 4096):  # several writes: the pump sees the line arrive in parts
    sys.stdout.buffer.write(bytes(line[start:start + 4096]))
    sys.stdout.buffer.flush()
sys.stdout.buffer.write(b"\\n")
sys.stdout.flush()
print("ERROR: login refused for token " + tok, file=sys.stderr, flush=True)
sys.exit(1)
"""

#: The termination reason it must end with, the value masked.
LEAKY_REASON = "ERROR: login refused for token *** (exit code 1)"
