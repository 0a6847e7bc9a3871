"""An ivshmem server (QEMU's protocol, version 0) for the kernel tests: Debian ships none.

QEMU's ivshmem-doorbell devices connect to a UNIX socket. The server hands each one its
peer number, the shared memory and one eventfd per interrupt vector of every peer (its own
included); a device rings a peer by writing that peer's eventfd, which QEMU turns into an
MSI-X interrupt there. Messages are little-endian int64 values, some with a descriptor
(SCM_RIGHTS): version 0; the new peer's number; -1 with the memory; then, per vector, a
peer number with its eventfd, for every peer already there and for the new one (the others
are told of it the same way). Peers that leave are not announced: the guests of a test end
together.

  server = IvshmemServer(path, size=1 << 20, vectors=4); server.start(); ...; server.stop()
"""

import os
import socket
import struct
import threading


class IvshmemServer:
    def __init__(self, path, size=1 << 20, vectors=4):
        self.path = path
        self.vectors = vectors
        self.mem = os.memfd_create("pcientb-ivshmem")
        os.ftruncate(self.mem, size)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.peers = {}  # number -> (connection, [eventfd per vector])
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.stopped = False

    @staticmethod
    def _send(conn, value, fd=None):
        data = struct.pack("<q", value)
        if fd is None:
            conn.sendall(data)
        else:
            socket.send_fds(conn, [data], [fd])

    def _serve(self):
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                number = next(n for n in range(1 << 16) if n not in self.peers)
                fds = [os.eventfd(0) for _ in range(self.vectors)]
                self._send(conn, 0)
                self._send(conn, number)
                self._send(conn, -1, self.mem)
                for other, (oconn, ofds) in sorted(self.peers.items()):
                    for fd in ofds:
                        self._send(conn, other, fd)
                    for fd in fds:
                        self._send(oconn, number, fd)
                for fd in fds:
                    self._send(conn, number, fd)
                self.peers[number] = (conn, fds)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopped = True
        self.sock.close()
        with self.lock:
            for conn, fds in self.peers.values():
                conn.close()
                for fd in fds:
                    os.close(fd)
            self.peers.clear()
        os.close(self.mem)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
