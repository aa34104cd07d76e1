"""The pool of flat buffers ZeRO's gathers and gradient buckets reuse step to step."""

import random

import torch

from ortrain.runtime.buffer_pool import BufferPool, ReusePool, release_kept


def test_a_buffer_given_back_is_handed_out_again_for_its_size():
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(1000)
    ptr = a.data_ptr()
    a.fill_(3.0)
    pool.give(a)
    del a
    b = pool.take(1000)
    assert b.data_ptr() == ptr and pool.reused == 1
    pool.give(b)
    c = pool.take(1000, zero=True)  # reused, and zeroed as asked
    assert c.data_ptr() == ptr and torch.count_nonzero(c) == 0
    d = pool.take(500)  # another size: a buffer of its own
    assert d.data_ptr() != ptr and pool.out_numel == 1500


def test_a_buffer_something_else_still_reads_is_not_reused():
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(1000)
    a.fill_(1.0)
    kept = a[10:20]  # eager code kept a view of it
    ptr = a.data_ptr()
    pool.give(a)
    del a
    b = pool.take(1000)
    assert b.data_ptr() != ptr and pool.reused == 0
    b.fill_(2.0)
    assert torch.equal(kept, torch.ones(10))  # what the view reads is untouched


def test_a_buffer_given_back_while_viewed_is_handed_out_once_the_view_goes():
    pool = BufferPool(torch.device("cpu"))
    a, other = pool.take(256), pool.take(256)  # two at once: the pool may keep two
    pool.give(other)
    del other
    ptr = a.data_ptr()
    view = a[16:32].view(4, 4)  # autograd holds a gradient view until the step ends
    pool.give(a)
    del a
    assert pool.free_numel == 512  # kept, not dropped
    b = pool.take(256)  # the view still reads it: the other one
    assert b.data_ptr() != ptr and pool.reused == 1
    del view
    c = pool.take(256)  # nothing else reads it now
    assert c.data_ptr() == ptr and pool.reused == 2


def test_a_buffer_whose_view_outlives_the_give_is_not_reused():
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(64)
    pool.give(a)
    view = a[:8]  # taken after it was given back: the take sees it
    ptr = a.data_ptr()
    del a
    b = pool.take(64)
    assert b.data_ptr() != ptr and view.data_ptr() == ptr


def test_a_forgotten_buffer_is_never_handed_out_again():
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(100)
    ptr = a.data_ptr()
    pool.forget(a)  # a collective may still write it
    b = pool.take(100)
    assert b.data_ptr() != ptr and pool.out_numel == 100


def test_the_pool_never_holds_more_than_the_most_handed_out_at_once():
    rng = random.Random(0)
    pool = BufferPool(torch.device("cpu"))
    out: list[torch.Tensor] = []
    most = 0
    for _ in range(400):
        if out and rng.random() < 0.5:
            pool.give(out.pop(rng.randrange(len(out))))
        else:
            out.append(pool.take(rng.choice([16, 64, 256, 1024])))
        handed = sum(t.numel() for t in out)
        most = max(most, handed)
        assert pool.out_numel == handed
        assert pool.free_numel + pool.out_numel <= pool.peak_numel == most
    assert pool.reused > 0


def _users(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def test_an_output_whose_users_let_go_is_made_again_over_the_same_memory():
    pool = ReusePool()
    a = pool.empty((4, 8), torch.float32)
    assert a.shape == (4, 8) and a.dtype == torch.float32
    ptr = a.data_ptr()
    # nothing but the tensor holds its storage, as for torch.empty: autograd may add into
    # a gradient in place, and AccumulateGrad may take it as .grad
    assert _users(a) == _users(torch.empty(4, 8))
    del a
    b = pool.empty((32,), torch.float32)  # same size and dtype, another shape
    assert b.data_ptr() == ptr and b.shape == (32,) and pool.reused == 1
    c = pool.empty((32,), torch.float16)  # another dtype: memory of its own
    assert c.data_ptr() != ptr


def test_an_output_still_held_is_never_handed_out_again():
    pool = ReusePool()
    a = pool.empty((16,), torch.float32)
    a.fill_(1.0)
    kept = a[2:6]  # a view outlives the tensor (eager code, autograd's saved values)
    del a
    b = pool.empty((16,), torch.float32)
    b.fill_(2.0)
    assert torch.equal(kept, torch.ones(4)) and pool.reused == 0
    del kept, b
    assert pool.empty((16,), torch.float32) is not None and pool.reused == 1


def test_the_outputs_kept_never_exceed_the_most_handed_out_at_once():
    rng = random.Random(1)
    pool = ReusePool()
    out: list[torch.Tensor] = []
    most = 0
    for _ in range(400):
        if out and rng.random() < 0.5:
            out.pop(rng.randrange(len(out)))
        else:
            shape = rng.choice([(4,), (2, 8), (64,), (8, 32), (1024,)])
            out.append(pool.empty(shape, rng.choice([torch.float32, torch.int64])))
        handed = sum(t.nbytes for t in out)
        most = max(most, handed)
        assert pool.out_bytes == handed
        assert pool.free_bytes + pool.out_bytes <= pool.peak_bytes == most
    assert pool.reused > 0


def test_outputs_let_go_on_other_threads_come_back_counted():
    """A collective's worker may hold an output (a gradient it reduces) last."""
    import threading

    pool = ReusePool()
    for _ in range(20):
        held = [pool.empty((256,), torch.float32) for _ in range(8)]
        workers = [threading.Thread(target=held.pop) for _ in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert not held and pool.out_bytes == 0
        assert pool.free_bytes + pool.out_bytes <= pool.peak_bytes == 8 * 256 * 4
    assert pool.reused == 19 * 8


def test_release_kept_lets_every_pools_kept_buffers_go():
    """Before a ZeRO rank's first update takes its optimizer state's pages, the buffers
    both kinds of pool keep for the next step go (their memory and that state's would
    otherwise add up); what is handed out stays counted, and the pools fill again."""
    flat, outputs = BufferPool(torch.device("cpu")), ReusePool()
    a, b = flat.take(1000), flat.take(400)
    flat.give(a)
    out = outputs.empty((10, 10), torch.float32)
    del out
    assert flat.free_numel == 1000 and outputs.free_bytes == 400
    release_kept()
    assert flat.free_numel == 0 and outputs.free_bytes == 0
    assert flat.out_numel == 400 and outputs.out_bytes == 0
    again = flat.take(1000)  # made afresh: nothing kept to reuse
    assert flat.reused == 0 and again.numel() == 1000
    flat.give(b)
    assert flat.free_numel == 400
