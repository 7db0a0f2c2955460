#!/usr/bin/env python3
"""Container escape-surface probe for sandboxd.

Run INSIDE a sandbox container (python3 stdlib only).  Each probe issues one
raw system call through libc's syscall() and reports whether the kernel let it
through.  Prints exactly one JSON object on stdout:

    {"<probe>": {"ok": bool, "errno": int, "errname": str}, ...}

ok=True means the call succeeded (the resource was created and immediately
closed).  errno/errname are 0/"" on success.  A probe whose process was killed
by a signal reports errno=-<signum> and errname="signal:<NAME>".

Every probe runs in its own forked child, so side effects (being ptraced, a
new user namespace, a mount) never leak into the next probe.

No network traffic is sent: sockets are created and closed, never connected,
bound or written to.
"""

import ctypes
import errno
import json
import mmap
import os
import platform
import signal
import sys
import tempfile

# --- syscall numbers ---------------------------------------------------------

_NR = {
    "x86_64": {
        "socket": 41, "socketpair": 53, "ptrace": 101, "mount": 165,
        "keyctl": 250, "unshare": 272, "perf_event_open": 298, "bpf": 321,
        "userfaultfd": 323, "io_uring_setup": 425,
    },
    "aarch64": {
        "socket": 198, "socketpair": 199, "ptrace": 117, "mount": 40,
        "keyctl": 219, "unshare": 97, "perf_event_open": 241, "bpf": 280,
        "userfaultfd": 282, "io_uring_setup": 425,
    },
}
MACHINE = platform.machine()
NR = _NR.get(MACHINE, _NR["x86_64"])

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK = 1, 2, 10, 16, 17, 38, 40
SOCK_STREAM, SOCK_DGRAM, SOCK_RAW, SOCK_SEQPACKET = 1, 2, 3, 5
SOCK_CLOEXEC = 0o2000000
IPPROTO_ICMP = 1
ETH_P_ALL_BE = 0x0300  # htons(ETH_P_ALL)
NETLINK_ROUTE = 0
PTRACE_TRACEME = 0
CLONE_NEWUSER = 0x10000000
KEYCTL_GET_KEYRING_ID = 0
KEY_SPEC_SESSION_KEYRING = -3
BPF_MAP_CREATE = 0
BPF_MAP_TYPE_ARRAY = 2

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def sys_call(name, *args):
    """Raw syscall; returns (ret, errno)."""
    cargs = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    ret = _syscall(ctypes.c_long(NR[name]), *cargs)
    return ret, (ctypes.get_errno() if ret == -1 else 0)


def _close_if_fd(ret):
    if ret >= 0:
        try:
            os.close(ret)
        except OSError:
            pass


# --- probes: each returns (ok, errno) ----------------------------------------

def p_socket(family, type_, proto=0):
    def probe():
        ret, err = sys_call("socket", family, type_ | SOCK_CLOEXEC, proto)
        _close_if_fd(ret)
        return ret >= 0, err
    return probe


def p_socketpair(family, type_):
    def probe():
        fds = (ctypes.c_int * 2)(-1, -1)
        ret, err = sys_call("socketpair", family, type_ | SOCK_CLOEXEC, 0, fds)
        if ret == 0:
            _close_if_fd(fds[0])
            _close_if_fd(fds[1])
        return ret == 0, err
    return probe


def p_io_uring():
    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    ret, err = sys_call("io_uring_setup", 1, params)
    _close_if_fd(ret)
    return ret >= 0, err


def p_ptrace_traceme():
    ret, err = sys_call("ptrace", PTRACE_TRACEME, 0, 0, 0)
    return ret == 0, err


def p_unshare_userns():
    ret, err = sys_call("unshare", CLONE_NEWUSER)
    return ret == 0, err


def p_mount_tmpfs():
    base = tempfile.mkdtemp(prefix="x", dir="/tmp") if os.access("/tmp", os.W_OK) else "/tmp/x"
    ret, err = sys_call("mount", ctypes.c_char_p(b"tmpfs"), ctypes.c_char_p(base.encode()),
                        ctypes.c_char_p(b"tmpfs"), 0, None)
    if ret == 0:
        _libc.umount2(ctypes.c_char_p(base.encode()), 2)  # MNT_DETACH
    return ret == 0, err


def p_keyctl():
    ret, err = sys_call("keyctl", KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)
    return ret >= 0, err


def p_bpf():
    # union bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size, max_entries
    attr = (ctypes.c_uint32 * 32)(BPF_MAP_TYPE_ARRAY, 4, 4, 1)
    ret, err = sys_call("bpf", BPF_MAP_CREATE, attr, ctypes.sizeof(attr))
    _close_if_fd(ret)
    return ret >= 0, err


def p_perf_event_open():
    # struct perf_event_attr (PERF_ATTR_SIZE_VER5 = 112 bytes):
    # type=PERF_TYPE_SOFTWARE(1), size, config=PERF_COUNT_SW_TASK_CLOCK(1),
    # flags: disabled | exclude_kernel | exclude_hv
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(attr, (ctypes.c_uint32 * 2)(1, 112), 8)
    ctypes.memmove(ctypes.byref(attr, 8), (ctypes.c_uint64 * 1)(1), 8)
    ctypes.memmove(ctypes.byref(attr, 40), (ctypes.c_uint64 * 1)(1 | (1 << 5) | (1 << 6)), 8)
    ret, err = sys_call("perf_event_open", attr, 0, -1, -1, 0)
    _close_if_fd(ret)
    return ret >= 0, err


def p_userfaultfd():
    ret, err = sys_call("userfaultfd", 0o2000000)  # O_CLOEXEC
    _close_if_fd(ret)
    return ret >= 0, err


# i386 ABI (int 0x80) from this 64-bit process: seccomp sees AUDIT_ARCH_I386,
# which Docker profiles allow as a sub-architecture.  Checks that the 32-bit
# socketcall() multiplexer cannot be used to get around the socket() rules.
_I386_STUB = bytes([
    0x53,              # push rbx
    0x89, 0xF8,        # mov eax, edi      (nr)
    0x89, 0xF3,        # mov ebx, esi      (arg1)
    0x49, 0x89, 0xC8,  # mov r8, rcx       (save arg3)
    0x89, 0xD1,        # mov ecx, edx      (arg2)
    0x44, 0x89, 0xC2,  # mov edx, r8d      (arg3)
    0xCD, 0x80,        # int 0x80
    0x5B,              # pop rbx
    0x48, 0x63, 0xC0,  # movsxd rax, eax
    0xC3,              # ret
])
I386_SOCKETCALL, I386_SOCKET, SYS_SOCKET = 102, 359, 1


def _i386_call(nr, a1, a2, a3):
    mmap_ = _libc.mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
    prot = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40  # MAP_32BIT
    page = mmap_(None, 4096, prot, flags, -1, 0)
    if page in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    ctypes.memmove(page, _I386_STUB, len(_I386_STUB))
    fn = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long,
                          ctypes.c_long, ctypes.c_long)(page)
    ret = fn(nr, a1, a2, a3)
    return ret


def p_i386_socketcall_vsock():
    if MACHINE != "x86_64":
        return False, errno.ENOSYS
    args = (ctypes.c_uint32 * 3)(AF_VSOCK, SOCK_STREAM, 0)
    # args must be addressable with 32 bits: copy into the low page too
    buf = _alloc_low(ctypes.sizeof(args))
    ctypes.memmove(buf, args, ctypes.sizeof(args))
    ret = _i386_call(I386_SOCKETCALL, SYS_SOCKET, buf, 0)
    if ret >= 0:
        _close_if_fd(ret)
        return True, 0
    return False, -ret


def p_i386_socket_vsock():
    if MACHINE != "x86_64":
        return False, errno.ENOSYS
    ret = _i386_call(I386_SOCKET, AF_VSOCK, SOCK_STREAM, 0)
    if ret >= 0:
        _close_if_fd(ret)
        return True, 0
    return False, -ret


def _alloc_low(size):
    mmap_ = _libc.mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
    p = mmap_(None, max(size, 4096), mmap.PROT_READ | mmap.PROT_WRITE,
              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40, -1, 0)
    if p in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return p


PROBES = {
    # should be denied by the sandboxd profile
    "io_uring_setup": p_io_uring,
    "ptrace_traceme": p_ptrace_traceme,
    "socket_af_vsock": p_socket(AF_VSOCK, SOCK_STREAM),
    # family 0x1_00000028: the kernel truncates it to int 40 (AF_VSOCK); a
    # "family != 40" filter on the full 64-bit register would let it through.
    "socket_af_vsock_highbits": p_socket((1 << 32) | AF_VSOCK, SOCK_STREAM),
    "socket_af_alg": p_socket(AF_ALG, SOCK_SEQPACKET),
    "socket_af_packet_raw": p_socket(AF_PACKET, SOCK_RAW, ETH_P_ALL_BE),
    "socket_af_inet_raw": p_socket(AF_INET, SOCK_RAW, IPPROTO_ICMP),
    "socket_af_inet6_raw": p_socket(AF_INET6, SOCK_RAW, 58),  # IPPROTO_ICMPV6
    "socketpair_af_inet": p_socketpair(AF_INET, SOCK_STREAM),
    "i386_socketcall_af_vsock": p_i386_socketcall_vsock,
    "i386_socket_af_vsock": p_i386_socket_vsock,
    "unshare_newuser": p_unshare_userns,
    "mount_tmpfs": p_mount_tmpfs,
    "keyctl": p_keyctl,
    "bpf": p_bpf,
    "perf_event_open": p_perf_event_open,
    "userfaultfd": p_userfaultfd,
    # controls: should be allowed
    "socket_af_inet_stream": p_socket(AF_INET, SOCK_STREAM),
    "socket_af_inet_dgram": p_socket(AF_INET, SOCK_DGRAM),
    "socket_af_inet6_stream": p_socket(AF_INET6, SOCK_STREAM),
    "socket_af_unix_stream": p_socket(AF_UNIX, SOCK_STREAM),
    "socket_af_unix_dgram": p_socket(AF_UNIX, SOCK_DGRAM),
    "socket_af_netlink_route": p_socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE),
    "socketpair_af_unix": p_socketpair(AF_UNIX, SOCK_STREAM),
}


def run_isolated(fn, timeout=10):
    """Run fn() in a forked child; return {"ok", "errno", "errname"}."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(rfd)
            signal.alarm(timeout)
            try:
                ok, err = fn()
                payload = {"ok": bool(ok), "errno": int(err)}
            except Exception as exc:  # report, do not crash the whole probe
                payload = {"ok": False, "errno": getattr(exc, "errno", None) or -1,
                           "exception": repr(exc)}
            os.write(wfd, json.dumps(payload).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    chunks = []
    while True:
        b = os.read(rfd, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if os.WIFSIGNALED(status) and not data:
        sig = os.WTERMSIG(status)
        return {"ok": False, "errno": -sig, "errname": "signal:" + signal.Signals(sig).name}
    try:
        res = json.loads(data.decode())
    except ValueError:
        return {"ok": False, "errno": -1, "errname": "probe-error:no-result"}
    err = res["errno"]
    out = {"ok": res["ok"], "errno": 0 if res["ok"] else err,
           "errname": "" if res["ok"] else errno.errorcode.get(err, "E?%d" % err)}
    if "exception" in res:
        out["errname"] = "probe-error:" + res["exception"]
    return out


def main(argv):
    names = argv[1:] or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        sys.stderr.write("unknown probes: %s\n" % ", ".join(unknown))
        return 2
    results = {name: run_isolated(PROBES[name]) for name in names}
    sys.stdout.write(json.dumps(results, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
