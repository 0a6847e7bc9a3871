#!/usr/bin/python3
"""The MPI program of integration.mpi.mpi4py.*: every rank runs this (mpi4py, Open MPI).

  pcientb-mpirun -n N /usr/bin/python3 mpi4py_check.py

Point-to-point (ring Sendrecv, Isend/Irecv with every other rank, 0 B..4 MiB),
collectives (Bcast, Allreduce, Alltoall, Allgather, Reduce) and one-sided
communication (Win.Create with Put/Get/Accumulate in fence epochs, Win.Allocate
with Put/Get in lock/unlock epochs), every received byte compared with what its
sender wrote. Stdlib only (no numpy): buffers are bytearray and array.array.

Each rank prints `mpi4py-check rank=R ok <part>` per part, and rank 0 ends with
`mpi4py-check done ranks=N remote_bytes=B`, B being the bytes that certainly
crossed between two different ranks (the point-to-point and one-sided payloads;
the collectives' traffic depends on the algorithm and is not counted). A
mismatch raises, which aborts the job with a non-zero status.
"""

import array
import os

from mpi4py import MPI

SIZES = [0, 1, 8, 63, 64, 1000, 4096, 8192, 65536, 65537, 1 << 20, 4 << 20]


def pattern(seed, n):
    """n bytes that differ for every (seed, n); period 251 (prime) catches shifted pieces."""
    block = bytes((seed * 31 + n + i * 7) % 256 for i in range(251))
    return (block * (n // 251 + 1))[:n]


def say(text):
    """One write(2) per line: the launcher forwards each rank's output in the chunks
    it reads, so print()'s separate text and newline writes can interleave."""
    os.write(1, (text + "\n").encode())


def check(what, got, want):
    if bytes(got) != bytes(want):
        bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise AssertionError(f"{what}: {len(got)} bytes differ from the {len(want)} expected, "
                             f"first at offset {bad}")


def main():
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        raise SystemExit("mpi4py_check.py needs at least 2 ranks")
    right, left = (rank + 1) % n, (rank - 1) % n
    remote = 0  # bytes this rank sent (or put/got) to another rank

    def ok(part):
        say(f"mpi4py-check rank={rank} ok {part}")

    # --- point-to-point --------------------------------------------------------------
    for size in SIZES:
        recv = bytearray(size)
        comm.Sendrecv([pattern(rank, size), MPI.BYTE], dest=right, sendtag=size % 32768,
                      recvbuf=[recv, MPI.BYTE], source=left, recvtag=size % 32768)
        check(f"Sendrecv {size} B from rank {left}", recv, pattern(left, size))
        remote += size
    # Every pair at once, nonblocking: several messages in flight per peer.
    for size in (8, 65536, 1 << 20):
        reqs, bufs = [], {}
        for peer in range(n):
            if peer == rank:
                continue
            bufs[peer] = bytearray(size)
            reqs.append(comm.Irecv([bufs[peer], MPI.BYTE], source=peer, tag=7))
        # Send buffers stay referenced until Waitall (MPI reads them until then).
        sends = [pattern(rank * 100 + peer, size) for peer in range(n)]
        for peer in range(n):
            if peer != rank:
                reqs.append(comm.Isend([sends[peer], MPI.BYTE], dest=peer, tag=7))
                remote += size
        MPI.Request.Waitall(reqs)
        for peer, buf in bufs.items():
            check(f"Irecv {size} B from rank {peer}", buf, pattern(peer * 100 + rank, size))
    # Python objects (pickled): small and large.
    obj = comm.sendrecv({"from": rank, "blob": pattern(rank, 300000)}, dest=right, source=left)
    if obj["from"] != left or obj["blob"] != pattern(left, 300000):
        raise AssertionError(f"sendrecv object from rank {left}: wrong content")
    ok("point-to-point")

    # --- collectives -----------------------------------------------------------------
    for size in (8, 4096, 1 << 20, 4 << 20):
        buf = bytearray(pattern(size, size)) if rank == 0 else bytearray(size)
        comm.Bcast([buf, MPI.BYTE], root=0)
        check(f"Bcast {size} B", buf, pattern(size, size))
    for count in (1, 1000, 131072):
        mine = array.array("q", (rank * 1000003 + i for i in range(count)))
        total = array.array("q", bytes(8 * count))
        comm.Allreduce([mine, MPI.INT64_T], [total, MPI.INT64_T], op=MPI.SUM)
        ranks_sum = n * (n - 1) // 2
        for i in (0, count // 2, count - 1):
            want = ranks_sum * 1000003 + n * i
            if total[i] != want:
                raise AssertionError(f"Allreduce({count}) [{i}] = {total[i]}, expected {want}")
        if list(total) != [ranks_sum * 1000003 + n * i for i in range(count)]:
            raise AssertionError(f"Allreduce({count}): wrong sums")
        mx = comm.allreduce(rank * 3 + count, op=MPI.MAX)
        if mx != (n - 1) * 3 + count:
            raise AssertionError(f"allreduce MAX = {mx}")
    for block in (1, 4096, 262144):
        send = bytearray(b"".join(pattern(rank * 64 + d, block) for d in range(n)))
        recv = bytearray(block * n)
        comm.Alltoall([send, MPI.BYTE], [recv, MPI.BYTE])
        for s in range(n):
            check(f"Alltoall {block} B from rank {s}", recv[s * block:(s + 1) * block],
                  pattern(s * 64 + rank, block))
    gathered = bytearray(65536 * n)
    comm.Allgather([pattern(rank, 65536), MPI.BYTE], [gathered, MPI.BYTE])
    for s in range(n):
        check(f"Allgather from rank {s}", gathered[s * 65536:(s + 1) * 65536], pattern(s, 65536))
    red = array.array("d", [0.0] * 4) if rank == 0 else None
    comm.Reduce([array.array("d", [rank, 1.0, 0.5 * rank, -rank]), MPI.DOUBLE],
                [red, MPI.DOUBLE] if rank == 0 else None, op=MPI.SUM, root=0)
    if rank == 0:
        s = n * (n - 1) / 2
        if list(red) != [s, float(n), 0.5 * s, -s]:
            raise AssertionError(f"Reduce: {list(red)}")
    comm.Barrier()
    ok("collectives")

    # --- one-sided: fence epochs on a window over our own buffer ---------------------
    # Rank r owns slot s of every window (s = source rank): peers Put into their slot.
    for size in (8, 4096, 65536, 1 << 20):
        mem = bytearray(size * n)
        win = MPI.Win.Create(mem, disp_unit=1, comm=comm)
        win.Fence()
        # Origin buffers of RMA calls must live until the epoch ends (the fence):
        # mpi4py keeps no reference, and UCX may read them only then (ud_v).
        origin = pattern(rank + 10, size)
        win.Put([origin, MPI.BYTE], right, target=(rank * size, size, MPI.BYTE))
        remote += size
        win.Fence()
        check(f"Put {size} B from rank {left}", mem[left * size:(left + 1) * size],
              pattern(left + 10, size))
        got = bytearray(size)
        # The right neighbour's slot `rank` holds what we put there.
        win.Get([got, MPI.BYTE], right, target=(rank * size, size, MPI.BYTE))
        remote += size
        win.Fence()
        check(f"Get {size} B from rank {right}", got, pattern(rank + 10, size))
        win.Free()
    acc_mem = array.array("q", [0] * 1024)
    win = MPI.Win.Create(acc_mem, disp_unit=8, comm=comm)
    win.Fence()
    origin = array.array("q", [rank + 1] * 1024)
    for target in range(n):
        win.Accumulate([origin, MPI.INT64_T], target, op=MPI.SUM)
    win.Fence()
    if list(acc_mem) != [n * (n + 1) // 2] * 1024:
        raise AssertionError(f"Accumulate: {acc_mem[:4]}...")
    win.Free()
    # --- one-sided: passive target (lock/unlock) on memory MPI allocates -------------
    size = 262144
    win = MPI.Win.Allocate(size * n, disp_unit=1, comm=comm)
    local = win.tomemory()
    local[:] = bytes(size * n)
    comm.Barrier()
    win.Lock(right, MPI.LOCK_SHARED)
    origin = pattern(rank + 20, size)
    win.Put([origin, MPI.BYTE], right, target=(rank * size, size, MPI.BYTE))
    win.Flush(right)
    got = bytearray(size)
    win.Get([got, MPI.BYTE], right, target=(rank * size, size, MPI.BYTE))
    win.Unlock(right)
    remote += 2 * size
    check(f"Get after Put (lock) {size} B at rank {right}", got, pattern(rank + 20, size))
    comm.Barrier()
    win.Lock(rank, MPI.LOCK_EXCLUSIVE)  # synchronise the public and private copies
    check(f"Put (lock) {size} B from rank {left}", local[left * size:(left + 1) * size],
          pattern(left + 20, size))
    win.Unlock(rank)
    comm.Barrier()
    win.Free()
    ok("one-sided")

    total = comm.reduce(remote, op=MPI.SUM, root=0)
    if rank == 0:
        say(f"mpi4py-check done ranks={n} remote_bytes={total}")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        say(f"mpi4py-check rank={MPI.COMM_WORLD.Get_rank()} MISMATCH: {e}")
        MPI.COMM_WORLD.Abort(1)
