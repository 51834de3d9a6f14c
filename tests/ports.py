"""Free TCP ports for the multi-process tests' launchers (torchrun's --master_port, accelerate launch's
--main_process_port), so that two test runs, or a test run beside a training run, never ask for the same port."""
import socket


def free_port(span: int = 1) -> int:
    """A port p on 127.0.0.1 that nothing holds now, with p + 1 ... p + span - 1 free too (a launch that opens a second
    store beside the group's, tests/late_release.py, asks for 2). The kernel picks p among its free ephemeral ports;
    another process could still take it before the launch binds it, a window of a second or so."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                for extra in range(1, span):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", port + extra))
            except OSError:
                continue
        return port
    raise OSError(f"no {span} consecutive free ports found")
