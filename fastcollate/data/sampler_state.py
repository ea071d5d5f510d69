"""Where a sampler's epoch stands, as a checkpoint holds it: the state of ``IndexBatches`` and
``TokenBudgetBatches``, and the sampler's part of a ``StatefulDataLoader`` state.

Both samplers lay an epoch out the same way: one order of the samples, the same in every process, cut
into batches that the ranks take in turn, so after each rank has taken ``k`` batches the samples consumed
are a prefix of the order. A state is that prefix in sample terms (``samples_done``) plus the layout it
was cut in (the segment: where it started, at which world size, how many batches each rank took), so a
resume never replays batches: it cuts the rest of the order afresh, or, at the same world size, takes
the same batches the uninterrupted run would have.

A state is plain Python values (ints, bools, strings, bytes, dicts) and small: it survives
``torch.save`` and ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

__all__ = [
    "Layout",
    "Position",
    "ResumableEpochs",
    "ResumeAllowance",
    "read_state",
    "sampler_state",
    "write_state",
]

STATE_FORMAT = 1


class Layout(Protocol):
    """One segment of an epoch as this rank takes it: ``count`` batches, the ``j``-th by ``batch(j)``;
    ``samples_done(taken)`` is the prefix of the epoch's order that every rank's first ``taken``
    batches consumed (the epoch's length once the segment is through)."""

    count: int

    def batch(self, j: int) -> Any: ...

    def samples_done(self, taken: int) -> int: ...


@dataclasses.dataclass
class Position:
    """An epoch's progress on this rank: the segment being taken (started at ``start`` samples into the
    epoch's order, cut for ``world_size`` ranks), the batches before it and the ones taken in it."""

    epoch: int
    start: int
    world_size: int
    batches_before: int
    layout: Layout
    taken: int = 0  # batches handed out in this segment, including those taken before a resume
    exhausted: bool = False  # an iteration ran through the segment: the next one is a fresh epoch
    generator_state: bytes | None = None  # the generator before the epoch's draw (IndexBatches only)

    @property
    def epoch_length(self) -> int:
        """Batches this rank runs in the epoch: those before a resume and those of the segment."""
        return self.batches_before + self.layout.count


def write_state(sampler: str, made_for: dict, position: Position, n: int) -> dict:
    """The state of ``position``: a new dict of plain values each call, so a state once returned never
    changes."""
    done = position.taken >= position.layout.count
    return {
        "sampler": sampler,
        "format": STATE_FORMAT,
        "made_for": dict(made_for),
        "epoch": position.epoch,
        "samples_done": n if done else position.layout.samples_done(position.taken),
        "epoch_done": done,
        "iteration_ended": position.exhausted,
        "batches_done": position.batches_before + position.taken,
        "world_size": position.world_size,
        "segment_start": position.start,
        "segment_batches": position.taken,
        "generator_state": position.generator_state,
    }


def read_state(
    sampler: str,
    made_for: dict,
    state: object,
    world_size: int,
    layout_of: Callable[[int, int, int], Layout],
) -> Position:
    """The position ``state`` describes, laid out for ``world_size`` ranks; ``layout_of(epoch, start,
    world_size)`` lays a segment out. Raises ValueError naming what is wrong: a state of another sampler
    or made for other arguments, a loader's whole state, a malformed or inconsistent state."""
    fields = _checked_fields(sampler, made_for, state)
    epoch, saved_world = fields["epoch"], fields["world_size"]
    saved = layout_of(epoch, fields["segment_start"], saved_world)
    taken = fields["segment_batches"]
    if taken > saved.count:
        raise ValueError(
            f"{sampler}.load_state_dict: the state says each rank took {taken} batches of a segment that "
            f"has {saved.count}: it was not made by this sampler's arguments"
        )
    done = taken == saved.count
    samples_done = fields["n"] if done else saved.samples_done(taken)
    if fields["samples_done"] != samples_done or fields["epoch_done"] != done:
        raise ValueError(
            f"{sampler}.load_state_dict: the state's samples_done={fields['samples_done']} and "
            f"epoch_done={fields['epoch_done']} disagree with its segment (samples_done={samples_done}, "
            f"epoch_done={done}): the state was edited or made by another version"
        )
    before = fields["batches_done"] - taken
    if before < 0:
        raise ValueError(
            f"{sampler}.load_state_dict: batches_done={fields['batches_done']} is less than "
            f"segment_batches={taken}"
        )
    generator_state = fields["generator_state"]
    if (fields["segment_start"] == 0) != (before == 0):
        raise ValueError(
            f"{sampler}.load_state_dict: batches_done={fields['batches_done']} with segment_start="
            f"{fields['segment_start']} and segment_batches={taken}: a segment that starts the epoch has "
            "no batches before it, and one that starts later has some"
        )
    if fields["iteration_ended"] and not done:
        raise ValueError(f"{sampler}.load_state_dict: iteration_ended with epoch_done=False")
    if world_size == saved_world or done:
        # The same batches the uninterrupted run takes next (none once the epoch is through).
        return Position(
            epoch,
            fields["segment_start"],
            saved_world,
            before,
            saved,
            taken,
            exhausted=fields["iteration_ended"],
            generator_state=generator_state,
        )
    # Another world size: the rest of the order, cut afresh for the new ranks.
    layout = layout_of(epoch, samples_done, world_size)
    return Position(epoch, samples_done, world_size, before + taken, layout, generator_state=generator_state)


class ResumeAllowance(NamedTuple):
    """What a sampler's own rule lets an epoch resumed on another world size repeat and leave out, over
    the ids delivered before and after the checkpoint together: ``repeats`` surplus copies (padding) and
    ``drops`` samples never delivered (``drop_last``). A sampler states it with
    ``resume_allowance(world_size, resumed_world_size)``; ``doctor --resume-world-size`` holds it to it."""

    repeats: int
    drops: int


class ResumableEpochs:
    """What IndexBatches and TokenBudgetBatches share: the epoch under way (or the one a state loaded),
    its state, and a length that counts the batches run before a checkpoint. A sampler supplies
    ``_layout(epoch, start, world_size)``, ``_made_for()``, ``_count`` (the samples an epoch has) and
    ``_fresh_position()``, and claims a loaded position with ``_claim()`` at its iteration's first next()."""

    epoch: int
    world_size: int
    _count: int
    _position: Position | None = None  # the epoch under way, or the one a state loaded
    _resume_next: bool = False  # whether the next iteration continues a loaded position
    _loaded_ended: bool = False  # the position is a loaded state's whose iteration had ended

    def _layout(self, epoch: int, start: int, world_size: int) -> Layout:
        raise NotImplementedError

    def _made_for(self) -> dict:
        raise NotImplementedError

    def _fresh_position(self) -> Position:
        return Position(self.epoch, 0, self.world_size, 0, self._layout(self.epoch, 0, self.world_size))

    def _fresh_copy(self) -> Any:
        """A shallow copy (the same class, its attributes shared) with no epoch under way, as a sampler
        just made: epoch 0, and the epoch's state (a position under way or loaded) back at its default."""
        fresh = copy.copy(self)
        fresh.epoch = 0
        for name in _EPOCH_STATE:
            fresh.__dict__.pop(name, None)
        return fresh

    def _change_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_next = False  # a loaded position is its epoch's only
        self.epoch = epoch

    def _claim(self) -> Position | None:
        """The loaded position, once, if it is this epoch's. Claimed at an iteration's first next(),
        not at iter(): DataLoader makes iterators it never advances (one in its iterator's __init__,
        one in _reset, a restoring one a finished StatefulDataLoader throws away)."""
        position, resume = self._position, self._resume_next
        self._resume_next = False
        return position if resume and position is not None and position.epoch == self.epoch else None

    def _begin(self, position: Position) -> None:
        """``position`` is the iteration's now: len() counts it from here on (a loaded position that had
        ended is replaced only now, so len() never counts it while the new order is drawn)."""
        self._position = position
        self._loaded_ended = False

    def __len__(self) -> int:
        """Batches this rank runs in the current epoch; after ``load_state_dict``, those it ran before
        the checkpoint and those left, so a step count restored with the state ends where this does.

        The epoch's count holds until the next iteration starts (or ``set_epoch`` moves on), also after
        its iteration ran out: a loader that reads ahead (workers, a DeviceLoader's staged batches) runs
        out its sampler before the training loop has taken the last batches it counts. A loaded state
        whose iteration had ended counts the ordinary epoch that comes next."""
        position = self._position
        if position is not None and position.epoch == self.epoch and not self._loaded_ended:
            return position.epoch_length
        return self._layout(self.epoch, 0, self.world_size).count

    def state_dict(self) -> dict:
        """Where the current epoch stands, in sample terms: the epoch, how many samples of its order the
        batches handed out consumed (every rank's, as DDP ranks step in lockstep), the segment they were
        cut in, and the arguments the sampler was made with. Small (no index arrays) and plain values:
        ``torch.save`` it with the model. A returned state never changes; every rank's is the same."""
        position = self._position
        if position is None or position.epoch != self.epoch:
            position = self._fresh_position()
        return write_state(type(self).__name__, self._made_for(), position, self._count)

    def load_state_dict(self, state: dict) -> None:
        """Continues the epoch ``state`` was taken in, for one iteration: the next iteration hands out
        the batches the saved run had not, each sample once (none for a state taken after its last
        batch), and ``set_epoch(epoch + 1)`` then gives the ordinary next epoch; a state taken after the
        iteration ended leaves the next iteration the ordinary one. Restores the epoch; ``set_epoch``
        with another epoch drops the position.

        Any world size: with the saved one, the batches are the uninterrupted run's; with another, the
        samples not yet consumed are cut afresh for the new ranks, every rank running as many batches.

        Raises:
            ValueError: the state is another sampler's, or was made for other arguments (it names them),
                or is malformed.
        """
        position = read_state(type(self).__name__, self._made_for(), state, self.world_size, self._layout)
        self._restore(position)
        self.epoch = position.epoch
        self._position = position
        # A state taken after the iteration ended leaves nothing to continue: the next iteration is the
        # one the uninterrupted run would start (its next epoch, after set_epoch).
        self._resume_next = not position.exhausted
        self._loaded_ended = position.exhausted

    def _restore(self, position: Position) -> None:
        """What a sampler does with a loaded position before it waits for the next iteration."""


# The epoch's state is what ResumableEpochs gives a default in the class (its methods aside): named from
# the class, so that _fresh_copy resets every such attribute, those added later too.
_EPOCH_STATE = tuple(
    name
    for name, value in vars(ResumableEpochs).items()
    if name.startswith("_") and not name.startswith("__") and not callable(value)
)

_INTEGERS = ("epoch", "samples_done", "batches_done", "world_size", "segment_start", "segment_batches")


def _checked_fields(sampler: str, made_for: dict, state: object) -> dict:
    where = f"{sampler}.load_state_dict"
    if not isinstance(state, Mapping):
        raise TypeError(f"{where}: expected the dict state_dict() returned, got {type(state).__name__}")
    if "_snapshot" in state or "_index_sampler_state" in state:
        raise ValueError(
            f"{where}: this is a StatefulDataLoader's whole state; load it with loader.load_state_dict, or "
            "take the sampler's part with fastcollate.sampler_state(loader_state) (any num_workers)"
        )
    kind = state.get("sampler")
    if kind is None:
        keys = ", ".join(map(repr, list(state)[:8]))
        raise ValueError(
            f"{where}: not a fastcollate sampler state (it has no 'sampler' key; its keys: {keys})"
        )
    if kind != sampler:
        raise ValueError(f"{where}: the state is {kind!r}'s, not {sampler}'s")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{where}: state format {state.get('format')!r}; this version reads {STATE_FORMAT}")
    missing = [
        key
        for key in (*_INTEGERS, "made_for", "epoch_done", "iteration_ended", "generator_state")
        if key not in state
    ]
    if missing:
        raise ValueError(f"{where}: the state lacks {', '.join(missing)}")
    for key in _INTEGERS:
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: {key} must be an integer >= 0, got {value!r}")
    if state["world_size"] < 1:
        raise ValueError(f"{where}: world_size must be at least 1, got {state['world_size']}")
    saved_for = state["made_for"]
    if not isinstance(saved_for, Mapping):
        raise ValueError(f"{where}: made_for must be a dict, got {type(saved_for).__name__}")
    differences = [
        f"{key}={saved_for.get(key, '(none)')!r} in the state, {value!r} here"
        for key, value in made_for.items()
        if saved_for.get(key) != value
    ]
    if differences:
        raise ValueError(
            f"{where}: the state was made for another sampler: {'; '.join(differences)}. Load it into a "
            "sampler made with the same arguments (rank and world_size may differ)"
        )
    if state["segment_start"] > made_for["n"] or state["samples_done"] > made_for["n"]:
        raise ValueError(f"{where}: the state's position is past the {made_for['n']} samples of the epoch")
    generator_state = state["generator_state"]
    if made_for.get("generator") and not isinstance(generator_state, bytes):
        raise ValueError(
            f"{where}: generator_state must be the bytes of a generator's state, got {generator_state!r:.40}"
        )
    if not made_for.get("generator") and generator_state is not None:
        raise ValueError(f"{where}: generator_state must be None for a sampler without a generator")
    return {**state, "n": made_for["n"]}


def sampler_state(loader_state: Mapping) -> dict:
    """The batch sampler's state inside a ``torchdata.stateful_dataloader.StatefulDataLoader``'s
    ``state_dict()``, taken at the last batch the loader yielded.

    ``StatefulDataLoader.load_state_dict`` refuses a state saved under another ``num_workers``; this one
    loads into the new loader's sampler whatever its workers (and, for fastcollate's samplers, whatever
    its world size)::

        sampler.load_state_dict(fastcollate.sampler_state(checkpoint["loader"]))
        loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=new_count)

    Raises:
        ValueError: the state is not a StatefulDataLoader's, its sampler kept no state, or it was taken
            between the loader's snapshots (``snapshot_every_n_steps`` above 1), when the sampler's part
            lags the batches yielded.
    """
    if not isinstance(loader_state, Mapping):
        raise TypeError(
            f"sampler_state: expected a StatefulDataLoader state dict, got {type(loader_state).__name__}"
        )
    if "_snapshot" in loader_state:  # workers: the state of the main process at the last snapshot
        since = loader_state.get("_steps_since_snapshot", 0)
        if since:
            raise ValueError(
                f"sampler_state: the loader's state was taken {since} batches after its last snapshot, and "
                "its sampler's part lags by as many: make the StatefulDataLoader with "
                "snapshot_every_n_steps=1 (the default)"
            )
        main = loader_state["_snapshot"].get("_main_snapshot", {})
        state = main.get("_index_sampler_state")
    elif "_index_sampler_state" in loader_state:  # num_workers=0: taken at state_dict()
        state = loader_state["_index_sampler_state"]
    else:
        raise ValueError(
            "sampler_state: not a StatefulDataLoader state (no _snapshot or _index_sampler_state key); a "
            "sampler's own state_dict() loads as it is"
        )
    if state is None:
        raise ValueError(
            "sampler_state: the loader's batch sampler kept no state (it has no state_dict); use "
            "fastcollate.IndexBatches or TokenBudgetBatches as its batch_sampler"
        )
    return state
