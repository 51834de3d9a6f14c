"""A CodeTool held by an unprivileged user for its whole life, for tests/test_code_tool_boundary.py: this process is
that user's trainer. Started as root inside a private mount namespace (`unshare --mount`), it makes the Python
install and the project reachable for the user (code_sandbox.expose_python_to_nobody; nothing changes outside the
namespace), drops to the user for good, stays dumpable as a user's own process is, starts the tool, prints one JSON
line ({"pid", "sandbox", "line"}), then answers one JSON line per request line on stdin: {"code", "stdin"} -> the
ToolResult's fields; {"signals": true} -> how many SIGUSR2 it has received.

Usage (as root): unshare --mount python tests/tool_user.py UID BACKEND MODE TIMEOUT, MODE "probe" or "fallback"
(the servers' fallback without namespaces, forced).
"""
import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from sandbox import code_sandbox  # noqa: E402

PR_SET_DUMPABLE = 4


def main() -> None:
    uid, backend, mode, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    code_sandbox.expose_python_to_nobody()  # (root's 0700 home on the way to the install, e.g. pyenv's)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    code_sandbox._libc.prctl(PR_SET_DUMPABLE, 1)  # (a uid change clears it; a user's own trainer has it)
    received = []
    signal.signal(signal.SIGUSR2, lambda *_: received.append(1))
    import code_tool
    if mode == "fallback":
        from plumbing import tool_sandbox
        tool_sandbox._PROBED = code_tool.Sandbox("fallback-user", why="unshare failed: (test)")
    with code_tool.CodeTool(workers=1, timeout=timeout, preload=("math", "socket"), backend=backend) as tool:
        print(json.dumps({"pid": os.getpid(), "sandbox": tool.sandbox, "line": tool.sandbox_line}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("signals"):
                reply = {"signals": len(received)}
            else:
                result = tool.run(request["code"], request.get("stdin", ""))
                reply = {"status": result.status, "stdout": result.stdout, "stderr": result.stderr,
                         "elapsed": result.elapsed}
            print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
