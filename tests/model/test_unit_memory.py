"""pipelines/model/unit_memory.py: a streamed model's spare fp32 buffers (which buffers come back, and that the
numbers do not change, is the streamed model's part: test_streamed_model.py)."""

from __future__ import annotations

from pipelines.model.unit_memory import BufferPool


def test_a_given_back_buffer_serves_the_next_read_of_its_shape():
    pool = BufferPool()
    a = pool.take((4, 8))
    pool.give(a)
    assert pool.take((8, 4)).data_ptr() != a.data_ptr()  # another shape: new memory (and the spare let go)
    pool.give(a)
    b = pool.take([4, 8])  # a header's shape is a list
    assert b.data_ptr() == a.data_ptr() and tuple(b.shape) == (4, 8) and (pool.allocated, pool.reused) == (2, 1)


def test_spares_the_next_unit_cannot_use_are_let_go_before_it_reads():
    pool = BufferPool()
    for buf in [pool.take((4, 8)), pool.take((4, 8)), pool.take((2, 2))]:
        pool.give(buf)
    pool.keep_only([(4, 8)])  # one (4, 8) and no (2, 2) in the coming unit
    assert {shape: len(spares) for shape, spares in pool._spare.items()} == {(4, 8): 1}
    pool.take((16,))  # a read the spares cannot serve lets them all go before it allocates
    assert pool._spare == {} and pool.reused == 0
    pool.give(pool.take((3,)))
    pool.clear()
    assert pool._spare == {}
