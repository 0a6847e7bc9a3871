#!/usr/bin/env python3
"""Servers that hand a connection between processes (sdp.py's process.* cases).

  process_model.py client PORT          connect, send UP bytes of stream 1 (in sends of
                                        random sizes, some above the ZCopy threshold),
                                        shut down writing, read DOWN bytes of stream 2 and
                                        EOF; prints `process-result ok` or exits 1
  process_model.py server MODE PORT     accept one connection and serve it as MODE says
  process_model.py stdio FROM           (exec'd by the server) the rest of the exchange
                                        on stdin/stdout, from byte FROM of stream 1
  process_model.py fd FD FROM           (exec'd) the same on descriptor FD

MODE: how the serving is split (each part checks every byte it reads):
  system    reads all, runs system("true"), answers          (one process, spawns a child)
  popen     reads all, runs a command through popen, answers
  inetd     a forked child execs `stdio 0` before the connection is used (inetd, sshd)
  cgi       reads HALF, a forked child execs `stdio HALF` on the socket, the parent closes
  reexec    reads HALF, then the process execs `fd FD HALF` itself
  fork      reads HALF, a forked child goes on (Python), the parent closes
  daemon    reads HALF, calls daemon(3): the child goes on, the caller exits
  shell     reads all, sends the first third of the answer, has a shell's `cat` write the
            second third to the socket (system()), sends the last third: in that order
  subprocess  reads HALF, then a subprocess (stdin and stdout the socket) reads the rest
            and answers, while the server keeps the socket open (on-demand hand-back)
"""
import ctypes
import os
import random
import socket
import subprocess
import sys
import tempfile

UP = 4 << 20
HALF = 1 << 20
DOWN = 2 << 20


def stream(seed, n):
    return random.Random(seed).randbytes(n)


def read_exact(read, n, what):
    parts, got = [], 0
    while got < n:
        b = read(min(1 << 20, n - got))
        if not b:
            sys.exit(f"{what}: EOF after {got} of {n} bytes")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def serve_rest(read, write, start):
    """Bytes [start, UP) of stream 1, EOF, then stream 2: the rest of the exchange."""
    want = stream(1, UP)[start:]
    got = read_exact(read, len(want), f"server (from byte {start})")
    if got != want:
        i = next(i for i in range(len(want)) if got[i] != want[i])
        sys.exit(f"server: stream 1 differs at byte {start + i}")
    if read(1):
        sys.exit("server: data after the client's end")
    data = stream(2, DOWN)
    view = memoryview(data)
    while view:
        view = view[write(view):]


def reader(sock):
    return lambda n: sock.recv(n)


def writer(sock):
    return lambda b: sock.send(b)


def server(mode, port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(1)
    c, _ = ls.accept()
    ls.close()
    me = os.path.abspath(__file__)
    if mode == "inetd":
        pid = os.fork()
        if pid == 0:
            os.dup2(c.fileno(), 0)
            os.dup2(c.fileno(), 1)
            os.execv(sys.executable, [sys.executable, me, "stdio", "0"])
        c.close()
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    start = UP if mode in ("system", "popen", "shell") else HALF
    head = read_exact(reader(c), start, "server (first part)")
    if head != stream(1, UP)[:start]:
        sys.exit("server: stream 1 differs in the first part")
    if mode == "system":
        if os.system("true") != 0:
            sys.exit("system() failed")
        serve_rest(reader(c), writer(c), start)
    elif mode == "popen":
        if subprocess.check_output(["echo", "popen"]) != b"popen\n":
            sys.exit("popen: wrong output")
        serve_rest(reader(c), writer(c), start)
    elif mode == "shell":
        if c.recv(1):
            sys.exit("server: data after the client's end")
        down = stream(2, DOWN)
        a, b = DOWN // 3, 2 * DOWN // 3
        c.sendall(down[:a])
        with tempfile.NamedTemporaryFile() as f:
            f.write(down[a:b])
            f.flush()
            os.set_inheritable(c.fileno(), True)
            if os.system(f"cat {f.name} >&{c.fileno()}") != 0:
                sys.exit("the shell's cat failed")
        c.sendall(down[b:])
    elif mode == "subprocess":
        r = subprocess.run([sys.executable, me, "stdio", str(start)], stdin=c, stdout=c)
        if r.returncode != 0:
            sys.exit(f"subprocess exited {r.returncode}")
    elif mode == "cgi":
        pid = os.fork()
        if pid == 0:
            os.dup2(c.fileno(), 0)
            os.dup2(c.fileno(), 1)
            os.execv(sys.executable, [sys.executable, me, "stdio", str(start)])
        c.close()
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    elif mode == "reexec":
        os.set_inheritable(c.fileno(), True)
        os.execv(sys.executable, [sys.executable, me, "fd", str(c.fileno()), str(start)])
    elif mode == "fork":
        pid = os.fork()
        if pid == 0:
            serve_rest(reader(c), writer(c), start)
            c.close()
            os._exit(0)
        c.close()
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    elif mode == "daemon":
        if ctypes.CDLL(None, use_errno=True).daemon(1, 1) != 0:
            sys.exit("daemon() failed")
        serve_rest(reader(c), writer(c), start)  # in the daemon's process
    else:
        sys.exit(f"unknown mode {mode}")
    c.close()


def client(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    data = stream(1, UP)
    sizes = random.Random(3)
    off = 0
    while off < UP:
        n = min(UP - off, sizes.randint(1, 3 << 19))
        s.sendall(data[off:off + n])
        off += n
    s.shutdown(socket.SHUT_WR)
    got = read_exact(reader(s), DOWN, "client")
    if got != stream(2, DOWN):
        sys.exit("client: stream 2 differs")
    if s.recv(1):
        sys.exit("client: data after the server's end")
    s.close()
    print(f"process-result ok up={UP} down={DOWN}", flush=True)


def main():
    role = sys.argv[1]
    if role == "client":
        client(int(sys.argv[2]))
    elif role == "server":
        server(sys.argv[2], int(sys.argv[3]))
    elif role == "stdio":
        serve_rest(lambda n: os.read(0, n), lambda b: os.write(1, b), int(sys.argv[2]))
    elif role == "fd":
        fd = int(sys.argv[2])
        serve_rest(lambda n: os.read(fd, n), lambda b: os.write(fd, b), int(sys.argv[3]))
        os.close(fd)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
