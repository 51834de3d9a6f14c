"""Landlock and seccomp for the code tool: the kernel's limits on what a call's process may touch and which system
calls it may make, in force before the model's code runs (sandbox/code_sandbox.py: entered by the call child right after
the fork, or at the start of a subprocess-backend interpreter). Whatever the code starts inherits them; nothing can
lift them. Both work unprivileged (with no_new_privs set), as root and as any user.

Landlock (Linux 5.13+; man 7 landlock, Documentation/userspace-api/landlock.rst) allows, and denies all else:
- read and execute beneath the Python install (sys.prefix, sys.base_prefix and their exec twins) and the import
  roots of the offered modules (where numpy and sympy live, e.g. a site-packages outside the install); read beneath
  the loader's directories (/lib, /usr/lib, ...) and those of every shared library the process has mapped; read
  /etc/ld.so.cache and /etc/localtime; execute the dynamic loader (so that a `python -c ...` of the code runs);
- read, write, create, rename and remove (neither execute nor make device nodes) beneath `writable`: the call's
  own directory, or for the servers the private directory that holds it (emptied after every call) and the
  namespaced server's private /dev/shm;
- read and write /dev/null; read /dev/zero, /dev/random, /dev/urandom.
So: not $HOME, not the run folders or the project, not /tmp, not the machine's /dev/shm, not /proc (the code's own
entry included). ABI 4 (Linux 6.7): no TCP bind or connect. ABI 6 (6.12): signals and abstract unix sockets only
within the call's own processes. ABI 7 (6.15): the model's denied attempts stay out of the audit log. An older ABI
gets what it has: without ABI 3 (6.2) Landlock cannot stop truncation (seccomp refuses truncate(2) and a read-only
open with O_TRUNC instead); ABI 1 refuses every rename or link across directories.

seccomp (man 2 seccomp; a classic BPF program, include/uapi/linux/filter.h) returns EPERM, which Python raises as
PermissionError where the call is made, for: ptrace and other processes' memory; mount and namespace calls, and
clone with a namespace flag; kernel modules, kexec, reboot, bpf, perf_event_open, userfaultfd, keyrings, io_uring,
personality changes, clock and host settings, swap, accounting; socket() of any family (socketpair stays, for
multiprocessing.Pipe and asyncio), SysV IPC and POSIX message queues; and what Landlock does not govern: modes,
owners, times and extended attributes of files, inotify watches, truncate(2), a read-only open with O_TRUNC,
setrlimit and setpriority on other processes. clone3 and openat2 return ENOSYS (their flags sit in a struct BPF
cannot read), so that glibc falls back to clone and openat. Foreign system-call ABIs (i386 and x32 on x86_64, arm32
on aarch64) get EPERM. Numbers are per architecture (x86_64 and aarch64 here; elsewhere no seccomp layer), from
arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h.

Not covered: stat() works on every path (names and sizes are visible, contents are not); an import root that
holds more than modules (a PYTHONPATH folder with data in it) is readable; exec of a memfd (ctypes already runs
native code; it stays confined); connect() to a unix socket by path, which no Landlock ABI up to 7 governs (moot
while socket() is refused); the scheduling (affinity, I/O priority) of the same user's other processes; CPU and
memory, which are rlimits (code_sandbox.set_limits); side channels; kernel bugs.

Why raw system calls through ctypes, not a binding: the Landlock binding (`landlock`) is not on every package
index; pyseccomp (0.1.2, one file from 2021) needs the system's libseccomp, which a pip install cannot bring, and
finds it with ctypes.util.find_library, whose import of subprocess would bring threading's at-fork handler into
every call child (sandbox/code_sandbox.py's cost model). Cost decides the rest. Attaching a seccomp filter costs ~0.2 ms
(the kernel translates the program and precomputes its verdict per system call), and any Python a fresh child runs
costs copy-on-write faults: so the server builds the Landlock ruleset and installs the filter once, and each call
child inherits the filter and enters the ruleset with one system call (bench/code_tool.py measures it). The
kernel's user API is stable; tests/test_landlock_seccomp.py checks the tables below against the kernel headers.
"""
from __future__ import annotations

import ctypes
import os
import sys

# ------------------------------------------------------------------------------ include/uapi/linux/landlock.h
CREATE_RULESET_VERSION, RULE_PATH_BENEATH = 1 << 0, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK, FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
RESTRICT_SELF_LOG_SAME_EXEC_OFF = 1 << 0  # ABI 7
MAX_ABI = 7  # the newest ABI whose rights this module sets; a newer kernel keeps these
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # those a rule on a file may hold
READ = FS_READ_FILE | FS_READ_DIR
READ_EXEC = READ | FS_EXECUTE
SCRATCH = (READ | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SOCK
           | FS_MAKE_FIFO | FS_MAKE_SYM | FS_REFER | FS_TRUNCATE)  # no execute, no device nodes, no device ioctls
LOADER_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")  # the dynamic loader's default search path
READ_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/dev/zero", "/dev/random", "/dev/urandom")
LANDLOCK_NR = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # every architecture

# --------------------------------------------- include/uapi/linux/{seccomp,filter,bpf_common,audit,elf-em}.h
SECCOMP_SET_MODE_FILTER, SECCOMP_GET_ACTION_AVAIL, SECCOMP_FILTER_FLAG_SPEC_ALLOW = 1, 2, 1 << 2
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_W_ABS, ALU_AND_K, JEQ_K, JGE_K, RET_K = 0x20, 0x54, 0x15, 0x35, 0x06  # BPF_LD|BPF_W|BPF_ABS, ...
NR, ARCH, ARGS = 0, 4, 16  # offsets in struct seccomp_data; args[i] at 16 + 8i, its low 32 bits first (little-endian)
EPERM, ENOSYS = 1, 38
X32_SYSCALL_BIT = 0x40000000
PR_SET_NO_NEW_PRIVS = 38  # include/uapi/linux/prctl.h
CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (uapi/linux/sched.h)
O_ACCMODE, O_TRUNC = 0o3, 0o1000  # include/uapi/asm-generic/fcntl.h (x86_64 and aarch64 alike)
ALL = 0xFFFFFFFF

DENIED = (  # EPERM
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "process_mrelease", "kcmp", "pidfd_getfd",
    # mounts and namespaces
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    # the kernel and the machine
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "bpf",
    "perf_event_open", "userfaultfd", "add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "settimeofday",
    "clock_settime", "adjtimex", "clock_adjtime", "sethostname", "setdomainname", "iopl", "ioperm", "fanotify_init",
    "name_to_handle_at", "open_by_handle_at",
    # sockets, SysV IPC, POSIX message queues
    "socket", "shmget", "shmat", "shmctl", "semget", "semop", "semtimedop", "semctl", "msgget", "msgsnd", "msgrcv",
    "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    # what Landlock does not govern
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
    "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat", "file_setattr", "inotify_add_watch", "truncate",
)
NOT_IMPLEMENTED = ("clone3", "openat2")  # ENOSYS
ONLY_IF = {  # allowed only where every ((argument & mask) == value) == expected, else EPERM
    "openat": [(2, O_ACCMODE | O_TRUNC, O_TRUNC, False)],  # no O_TRUNC on a read-only open
    "open": [(1, O_ACCMODE | O_TRUNC, O_TRUNC, False)],
    "clone": [(0, CLONE_NEW, 0, True)],  # no new namespace
    "personality": [(0, ALL, ALL, True)],  # read it, never change it
    "prlimit64": [(0, ALL, 0, True)],  # its own limits (pid 0) only
    "setpriority": [(0, ALL, 0, True), (1, ALL, 0, True)],  # its own process (PRIO_PROCESS, 0) only
}
X86_64 = {  # arch/x86/entry/syscalls/syscall_64.tbl
    "open": 2, "shmget": 29, "shmat": 30, "shmctl": 31, "socket": 41, "clone": 56, "semget": 64, "semop": 65,
    "semctl": 66, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "truncate": 76, "chmod": 90, "fchmod": 91,
    "chown": 92, "fchown": 93, "lchown": 94, "ptrace": 101, "syslog": 103, "utime": 132, "personality": 135,
    "setpriority": 141, "pivot_root": 155, "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164,
    "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170,
    "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179,
    "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198,
    "fremovexattr": 199, "semtimedop": 220, "clock_settime": 227, "utimes": 235, "mq_open": 240, "mq_unlink": 241,
    "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "inotify_add_watch": 254, "openat": 257, "fchownat": 260,
    "futimesat": 261, "fchmodat": 268, "unshare": 272, "utimensat": 280, "perf_event_open": 298,
    "fanotify_init": 300, "prlimit64": 302, "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305,
    "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "seccomp": 317,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
}
AARCH64 = {  # include/uapi/asm-generic/unistd.h
    "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15, "fremovexattr": 16,
    "inotify_add_watch": 27, "umount2": 39, "mount": 40, "pivot_root": 41, "truncate": 45, "chroot": 51,
    "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "openat": 56, "quotactl": 60, "utimensat": 88,
    "acct": 89, "personality": 92, "unshare": 97, "kexec_load": 104, "init_module": 105, "delete_module": 106,
    "clock_settime": 112, "syslog": 116, "ptrace": 117, "setpriority": 140, "reboot": 142, "sethostname": 161,
    "setdomainname": 162, "settimeofday": 170, "adjtimex": 171, "mq_open": 180, "mq_unlink": 181,
    "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185, "msgget": 186,
    "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193,
    "shmget": 194, "shmctl": 195, "shmat": 196, "socket": 198, "add_key": 217, "request_key": 218, "keyctl": 219,
    "clone": 220, "swapon": 224, "swapoff": 225, "perf_event_open": 241, "prlimit64": 261, "fanotify_init": 262,
    "name_to_handle_at": 264, "open_by_handle_at": 265, "clock_adjtime": 266, "setns": 268,
    "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "seccomp": 277, "bpf": 280,
    "userfaultfd": 282, "kexec_file_load": 294,
}
COMMON = {  # numbered alike on every architecture since Linux 5.1
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435, "openat2": 437,
    "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "quotactl_fd": 443, "process_mrelease": 448,
    "fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "open_tree_attr": 467, "file_setattr": 469,
}
ARCHES = {"x86_64": (0xC000003E, {**X86_64, **COMMON}),  # AUDIT_ARCH_X86_64: EM_X86_64 | 64BIT | LE
          "aarch64": (0xC00000B7, {**AARCH64, **COMMON})}  # AUDIT_ARCH_AARCH64: EM_AARCH64 | 64BIT | LE

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
MACHINE = os.uname().machine if hasattr(os, "uname") else ""


class _RulesetAttr(ctypes.Structure):  # struct landlock_ruleset_attr (its size tells the kernel which ABI)
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):  # struct landlock_path_beneath_attr, packed
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFilter(ctypes.Structure):  # struct sock_filter: one BPF instruction
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _long(value: int) -> ctypes.c_long:
    return ctypes.c_long(value)


def _syscall(nr: int, *args) -> int:
    """syscall(2), every argument a ctypes object (a long or a pointer); raises OSError on failure."""
    result = _libc_syscall(_long(nr), *args)
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


if _libc is not None:  # fetched once, here: a call child then makes no symbol lookups
    _libc_syscall, _prctl = _libc.syscall, _libc.prctl
    _libc_syscall.restype = ctypes.c_long
    # The call child's one call: fixed argument types and no errno swapping touch fewer pages of the server's
    # memory, so the fresh child takes ~4 copy-on-write faults for it, not ~20 (~0.1 ms on a cloud VM).
    _syscall3 = ctypes.CDLL(None).syscall
    _syscall3.restype, _syscall3.argtypes = ctypes.c_long, (ctypes.c_long,) * 3


# ------------------------------------------------------------------------------------------ what the kernel has
def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none (not built, not enabled at boot, or refused by a
    container's own seccomp profile)."""
    try:
        return _syscall(LANDLOCK_NR["create_ruleset"], None, _long(0), _long(CREATE_RULESET_VERSION)) if _libc else 0
    except OSError:
        return 0


def seccomp_available() -> bool:
    """Whether a seccomp filter can return errors here: Linux with filters (SECCOMP_GET_ACTION_AVAIL), on an
    architecture whose numbers this module has."""
    if _libc is None or MACHINE not in ARCHES:
        return False
    try:
        return _syscall(ARCHES[MACHINE][1]["seccomp"], _long(SECCOMP_GET_ACTION_AVAIL), _long(0),
                        ctypes.byref(ctypes.c_uint32(RET_ERRNO))) == 0
    except OSError:
        return False


def describe(landlock: int, seccomp: bool) -> str:
    """The layers in one word each: "landlock(v7)+seccomp", "seccomp", "" (none)."""
    return "+".join(([f"landlock(v{min(landlock, MAX_ABI)})"] if landlock else []) + (["seccomp"] if seccomp else []))


# ------------------------------------------------------------------------------------------------- the rules
def import_roots(modules: tuple) -> list[str]:
    """The directories the non-standard-library modules among `modules` are imported from (their sys.path
    entries), found without importing them. (The standard library lives in the Python install.)"""
    roots = []
    for name in (m for m in modules if m not in sys.stdlib_module_names):
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module else None
        if module is None:
            from importlib.machinery import PathFinder
            spec = PathFinder.find_spec(name)
            origin = spec.origin if spec and spec.has_location else None
        if origin:  # (None: built into the interpreter, or not installed)
            folder = os.path.dirname(origin)
            roots.append(os.path.dirname(folder) if os.path.basename(origin).startswith("__init__.") else folder)
    return roots


def _mapped_files() -> set[str]:
    """The files this process has mapped (its shared libraries), from /proc/self/maps: address, permissions,
    offset, device, inode, path."""
    with open("/proc/self/maps") as f:
        paths = {fields[5].strip() for line in f if len(fields := line.split(None, 5)) == 6}
    return {p for p in paths if p.startswith("/") and not p.endswith("(deleted)")}


def path_rules(roots: tuple = (), writable: tuple = ()) -> list[tuple[str, int]]:
    """(path, allowed access) for every rule: the Python install and `roots`, the offered modules' import roots
    (import_roots), to read and execute; the loader's and the mapped libraries' directories to read; the dynamic
    loader to execute; a few system files and devices; and `writable` (SCRATCH). Paths are resolved; one beneath
    another read root goes."""
    mapped = _mapped_files()
    python = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, *roots}
    python = {os.path.realpath(p) for p in python if os.path.isdir(p)}
    libs = {os.path.realpath(p) for p in {*LOADER_DIRS, *map(os.path.dirname, mapped)} if os.path.isdir(p)}

    def beneath(path, roots):
        return any(path.startswith(root + "/") for root in roots if root != path)
    rules = [(p, READ_EXEC) for p in sorted(python) if not beneath(p, python)]
    rules += [(p, READ) for p in sorted(libs) if not beneath(p, python | libs)]
    rules += [(os.path.realpath(p), READ_EXEC) for p in mapped if os.path.basename(p).startswith("ld-")
              and os.path.isfile(p)]
    rules += [(os.path.realpath(p), FS_READ_FILE) for p in READ_FILES if os.path.exists(p)]
    rules += [("/dev/null", FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE)] if os.path.exists("/dev/null") else []
    return rules + [(os.path.realpath(p), SCRATCH) for p in writable]


def seccomp_program(machine: str, keep: tuple = ()) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions: check the architecture, then the system call's number;
    the ONLY_IF calls jump to their argument checks at the end. keep: names of DENIED calls left allowed."""
    audit_arch, numbers = ARCHES[machine]
    code = [(LD_W_ABS, 0, 0, ARCH), (JEQ_K, 0, "eperm", audit_arch), (LD_W_ABS, 0, 0, NR)]
    if machine == "x86_64":
        code.append((JGE_K, "eperm", 0, X32_SYSCALL_BIT))
    checked = [name for name in ONLY_IF if name in numbers]
    code += [(JEQ_K, name, 0, numbers[name]) for name in checked]
    code += [(JEQ_K, "eperm", 0, numbers[name]) for name in DENIED if name in numbers and name not in keep]
    code += [(JEQ_K, "enosys", 0, numbers[name]) for name in NOT_IMPLEMENTED]
    code.append((RET_K, 0, 0, RET_ALLOW))
    for name in checked:
        code.append(name)  # a label
        for arg, mask, value, expected in ONLY_IF[name]:
            code.append((LD_W_ABS, 0, 0, ARGS + 8 * arg))
            if mask != ALL:
                code.append((ALU_AND_K, 0, 0, mask))
            code.append((JEQ_K, 0, "eperm", value) if expected else (JEQ_K, "eperm", 0, value))
        code.append((RET_K, 0, 0, RET_ALLOW))
    code += ["eperm", (RET_K, 0, 0, RET_ERRNO | EPERM), "enosys", (RET_K, 0, 0, RET_ERRNO | ENOSYS)]
    labels, program = {}, []
    for item in code:  # labels mark the next instruction
        if isinstance(item, str):
            labels[item] = len(program)
        else:
            program.append(item)
    resolved = []
    for i, (op, jt, jf, k) in enumerate(program):  # a jump's offset counts from the next instruction
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        assert 0 <= jt < 256 and 0 <= jf < 256, "a BPF jump reaches at most 255 instructions"
        resolved.append((op, jt, jf, k))
    return resolved


# ---------------------------------------------------------------------------------------------- applying them
class Confinement:
    """The Landlock ruleset and the seccomp program, built once (rules added, instructions assembled) in the
    process that forks the calls, or in a call's own interpreter. landlock: the ABI to use (0: none); seccomp:
    have a filter; writable: the directories a call may write; roots: the offered modules' import roots (read and
    execute beneath them, import_roots); keep: DENIED calls the filter leaves allowed (a root server chowns each
    call directory to nobody; its calls, as nobody, own nothing else). Raises OSError where the kernel refuses."""

    def __init__(self, landlock: int, seccomp: bool, writable: tuple, roots: tuple = (), keep: tuple = ()):
        self.abi, self.ruleset, self.fprog = min(landlock, MAX_ABI), None, None
        if self.abi:
            fs = (FS_REFER - 1) | (FS_REFER if self.abi >= 2 else 0) | (FS_TRUNCATE if self.abi >= 3 else 0) | \
                (FS_IOCTL_DEV if self.abi >= 5 else 0)
            attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if self.abi >= 4 else 0,
                                SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if self.abi >= 6 else 0)
            size = 8 if self.abi < 4 else 16 if self.abi < 6 else 24  # the fields this ABI knows
            self.ruleset = _syscall(LANDLOCK_NR["create_ruleset"], ctypes.byref(attr), _long(size), _long(0))
            for path, access in path_rules(roots, writable):
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = _PathBeneath(access & fs & (ALL if os.path.isdir(path) else FILE_RIGHTS), fd)
                    _syscall(LANDLOCK_NR["add_rule"], _long(self.ruleset), _long(RULE_PATH_BENEATH),
                             ctypes.byref(rule), _long(0))
                finally:
                    os.close(fd)
            self.restrict_args = (LANDLOCK_NR["restrict_self"], self.ruleset,
                                  RESTRICT_SELF_LOG_SAME_EXEC_OFF if self.abi >= 7 else 0)
            _syscall3(LANDLOCK_NR["create_ruleset"], 0, CREATE_RULESET_VERSION)  # (its first call, here)
        if seccomp:
            program = seccomp_program(MACHINE, keep)
            self.filter = (_SockFilter * len(program))(*[_SockFilter(*insn) for insn in program])
            self.fprog = _SockFprog(len(program), ctypes.addressof(self.filter))

    def filter_self(self) -> None:
        """No new privileges, then the seccomp filter (if any) on this process and all it forks from now on: once
        per server, whose call children inherit it (attaching a filter costs ~0.2 ms: the kernel translates the
        program and precomputes its verdict for every system call), or once in a subprocess-backend call."""
        _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if self.fprog is not None:  # SPEC_ALLOW: no speculative-store-bypass mitigation forced on the code (older
            # kernels tie it to seccomp; it would slow the code, and side channels are out of scope anyway)
            _syscall(ARCHES[MACHINE][1]["seccomp"], _long(SECCOMP_SET_MODE_FILTER),
                     _long(SECCOMP_FILTER_FLAG_SPEC_ALLOW), ctypes.byref(self.fprog))

    def restrict(self) -> None:
        """Enter the Landlock domain (if any): for this process and all it starts, for good. Call it with
        no_new_privs set (filter_self, or inherited), before the code; then close the ruleset's descriptor."""
        if self.ruleset is not None and _syscall3(*self.restrict_args) != 0:
            nr, *args = self.restrict_args  # (again, to learn the error)
            _syscall(nr, *map(_long, args))
