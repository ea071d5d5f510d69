"""The dispatcher ops against pure-Python references, and torch.library.opcheck."""

import pytest
import torch

from fastcollate import ops
from tests.conftest import cpu_and_cuda


def sample_stack_inputs(device):
    samples = [torch.randn(3, 4, device=device) for _ in range(5)]
    return samples, torch.empty(5, 3, 4, device=device)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_stack_into_matches_torch_stack(device):
    samples, out = sample_stack_inputs(device)
    samples[1] = samples[1].t().contiguous().t()  # non-contiguous layout, same values
    ops.stack_into(samples, out)
    assert torch.equal(out, torch.stack(samples))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_stack_into_refuses_a_wrong_shape(device):
    samples, out = sample_stack_inputs(device)
    samples[2] = torch.randn(3, 5, device=device)
    with pytest.raises(RuntimeError, match="sample 2"):
        ops.stack_into(samples, out)


def test_pad_into_matches_pad_sequence():
    samples = [torch.arange(n) for n in (4, 1, 6)]
    out = torch.empty(3, 6, dtype=torch.int64)
    mask = torch.empty(3, 6, dtype=torch.bool)
    lengths = torch.empty(3, dtype=torch.int64)
    ops.pad_into(samples, -7, out, mask, lengths)
    expected = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-7)
    assert torch.equal(out, expected)
    assert lengths.tolist() == [4, 1, 6]
    assert torch.equal(mask, torch.arange(6)[None] < lengths[:, None])


PAD_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint16, torch.uint32,
              torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz, torch.complex32]
PAD_VALUES = [0, -1, 3, 2.5, -100, 300, 70000, 2**40, -2**63, 2**63, -2**63 - 1, 2**64 - 1, 1e10, 3.5e38,
              1e300, float("inf"), float("nan"), True, 1 + 2j]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=str)
def test_pad_values_convert_as_torch_full_does_or_are_refused(dtype):
    # The pad value's bytes are made without a tensor (no dispatcher call per batch): they must still be
    # torch.full's, value for value, and a value torch.full refuses (300 as int8) is refused here too.
    for value in PAD_VALUES:
        try:
            expected = torch.full((), value, dtype=dtype)
        except (RuntimeError, OverflowError):
            expected = None
        out = torch.empty(1, 2, dtype=dtype)
        args = ([torch.empty(0, dtype=dtype)], value, out, torch.empty(1, 2, dtype=torch.bool),
                torch.empty(1, dtype=torch.int64))
        if expected is None:
            with pytest.raises((RuntimeError, OverflowError)):  # OverflowError: no int64 or uint64 holds it
                ops.pad_into(*args)
            continue
        ops.pad_into(*args)
        got = out[0].contiguous().view(torch.uint8).tolist()
        assert got == expected.expand(2).contiguous().view(torch.uint8).tolist(), (dtype, value)


def test_gather_ragged_into_refuses_a_pad_the_output_dtype_cannot_hold_before_writing_anything():
    # int16 rows cast into int8: 300 is no int8, and out, mask and lengths must stay as they were.
    out = torch.full((2, 4), 7, dtype=torch.int8)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    lengths = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="int8"):
        ops.gather_ragged_into(torch.arange(6, dtype=torch.int16), torch.tensor([0, 2, 6]),
                               torch.tensor([0, 1]), 300, out, mask, lengths)
    assert out.eq(7).all() and not mask.any() and not lengths.any()


def test_pad_into_refuses_a_sample_longer_than_out():
    out = torch.empty(2, 3)
    with pytest.raises(RuntimeError, match="longer"):
        ops.pad_into([torch.ones(2), torch.ones(4)], 0, out, torch.empty(2, 3, dtype=torch.bool),
                     torch.empty(2, dtype=torch.int64))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("channels_last", [False, True])
def test_normalize_images_matches_the_reference(device, channels_last):
    images = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8, device=device)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device)
    std = torch.tensor([0.229, 0.224, 0.225], device=device)
    out = ops.normalize_images(images, mean, std, torch.float32, channels_last)
    reference = (images.float() / 255 - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    torch.testing.assert_close(out, reference)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_opcheck_stack_into(device):
    samples, out = sample_stack_inputs(device)
    torch.library.opcheck(torch.ops.fastcollate.stack_into.default, (samples, out))


def test_opcheck_pad_into():
    samples = [torch.arange(n) for n in (2, 3)]
    args = (samples, 0, torch.empty(2, 3, dtype=torch.int64), torch.empty(2, 3, dtype=torch.bool),
            torch.empty(2, dtype=torch.int64))
    torch.library.opcheck(torch.ops.fastcollate.pad_into.default, args)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_opcheck_normalize_images(device):
    images = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8, device=device)
    mean, std = torch.rand(3, device=device), torch.rand(3, device=device) + 0.5
    torch.library.opcheck(torch.ops.fastcollate.normalize_images.default,
                          (images, mean, std, torch.float16, True))


def test_gather_into_matches_index_select_and_casts():
    source = torch.randn(50, 3, 4)
    indices = torch.tensor([7, 0, 49, 7])
    out = torch.empty(4, 3, 4)
    ops.gather_into(source, indices, out)
    assert torch.equal(out, source.index_select(0, indices))
    as_int = torch.empty(4, 3, 4, dtype=torch.float64)
    ops.gather_into(source, indices, as_int)
    assert torch.equal(as_int, source.index_select(0, indices).double())
    windows = torch.arange(30).as_strided((10, 5), (2, 1))  # overlapping rows, each contiguous
    out = torch.empty(3, 5, dtype=torch.int64)
    ops.gather_into(windows, torch.tensor([9, 0, 4]), out)
    assert torch.equal(out, windows[[9, 0, 4]])


def test_gather_into_refuses_rows_that_are_not_contiguous_and_a_wrong_out():
    with pytest.raises(RuntimeError, match="each row of source must be contiguous"):
        ops.gather_into(torch.zeros(4, 3).t(), torch.tensor([0]), torch.empty(1, 4))
    with pytest.raises(RuntimeError, match="out must have shape"):
        ops.gather_into(torch.zeros(4, 3), torch.tensor([0]), torch.empty(2, 3))


def test_opcheck_gather_into_and_gather_ragged_into():
    torch.library.opcheck(torch.ops.fastcollate.gather_into.default,
                          (torch.randn(8, 3), torch.tensor([1, 5]), torch.empty(2, 3)))
    args = (torch.arange(6), torch.tensor([0, 2, 6]), torch.tensor([1, 0]), 0,
            torch.empty(2, 4, dtype=torch.int64),
            torch.empty(2, 4, dtype=torch.bool), torch.empty(2, dtype=torch.int64))
    torch.library.opcheck(torch.ops.fastcollate.gather_ragged_into.default, args)


@pytest.mark.parametrize(("source_dtype", "out_dtype"), [
    (torch.uint16, torch.int64), (torch.uint8, torch.int64), (torch.int32, torch.float32),
    (torch.float16, torch.float32), (torch.float64, torch.float32), (torch.int64, torch.int32),
    (torch.float32, torch.int64), (torch.uint8, torch.float16), (torch.bool, torch.int64),
])
def test_gather_into_casts_as_torch_does_in_its_own_pass_or_through_aten(source_dtype, out_dtype):
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-3000, 60000, (40, 3, 5), generator=generator, dtype=torch.int64)
    source = (values.to(torch.float64) / 7 if source_dtype.is_floating_point else values).to(source_dtype)
    indices = torch.randint(0, 40, (17,), generator=generator)
    out = torch.empty(17, 3, 5, dtype=out_dtype)
    ops.gather_into(source, indices, out)
    assert torch.equal(out, source.index_select(0, indices).to(out_dtype))
