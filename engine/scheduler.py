"""Which requests hold cache slots, which wait for one (first come, first served), and what free slots keep.

A slot keeps its tokens' K/V after its request ends. With prefix caching on, a new request takes the
free slot whose kept tokens share the longest prefix with its prompt (ties, and no match: the least
recently used slot), and prefill starts after the shared part. A prefix that a running request holds is
copied from its slot instead when it is at least `copy_min_tokens` long (one long system prompt, many
users) or the whole prompt but its last token (the choices of one request); while such a prefix is still
being written, the new request waits for it rather than compute it again.

Where sliding layers keep only their window (a ring of C entries, engine/kv_cache.py), a slot that wrote
more than C positions holds the last C of them there: its prefix is reusable only whole (a next turn that
extends the conversation it holds), never cut short.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.request import Request, Status


@dataclass(frozen=True)
class SlotState:
    """What one KV-cache slot holds: a running request's tokens, or the tokens a free slot keeps for reuse."""

    slot: int
    state: str  # "free", "prefill" (its prompt still being written) or "decode"
    tokens: int  # positions written for the running request (0 when free)
    kept: int  # positions a free slot keeps for a later request sharing their prefix (0 when running)
    request_id: str | None = None


class Scheduler:
    def __init__(self, slots: int, prefix_caching: bool, copy_min_tokens: int, ring: int | None = None):
        self.prefix_caching = prefix_caching
        self.copy_min_tokens = copy_min_tokens
        self.ring = ring  # the most positions a slot holds with none lost from a ring (KVCache.ring_window); None: no rings
        self.free_slots = list(range(slots))  # least recently used first
        self.kept: list[list[int]] = [[] for _ in range(slots)]  # per slot: the tokens its first positions hold
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots, oldest first; each learns how many prompt tokens it reuses,
        and from which running slot they are to be copied (`copy_from`), if not kept in its own."""
        admitted = []
        for request in list(self.waiting):
            if not self.free_slots:
                break
            plan = self._plan(request)
            if plan is None:  # its prefix is being written by a running request: wait for it
                continue
            self.waiting.remove(request)
            request.slot, request.reused_tokens, request.copy_from = plan
            request.prefilled = request.reused_tokens
            self.free_slots.remove(request.slot)
            self.kept[request.slot] = []  # overwritten from reused_tokens on; kept again at release
            request.status = Status.RUNNING
            self.running[request.slot] = request
            admitted.append(request)
        return admitted

    def _plan(self, request: Request) -> tuple[int, int, int | None] | None:
        """(slot, prompt tokens reused, running slot to copy them from or None), or None to wait.

        At least the last prompt token is always computed: its output predicts the first new token.
        Prompt log-probabilities need every position computed.
        """
        if not self.prefix_caching or request.params.prompt_logprobs:
            return self.free_slots[0], 0, None
        prompt, most = request.prompt_ids, len(request.prompt_ids) - 1
        kept = {slot: self.reusable(len(self.kept[slot]), min(common_prefix(self.kept[slot], prompt), most))
                for slot in self.free_slots}
        slot = max(self.free_slots, key=kept.__getitem__)  # the first of equals: least recently used
        reused, source, coming = kept[slot], None, 0
        for other in self.running.values():
            shared = min(common_prefix(other.prompt_ids, prompt), most)  # what its prompt will write
            # Worth a copy: a long prefix, or all of this prompt (the siblings of an `n` > 1 request).
            if shared < self.copy_min_tokens and not 0 < shared == most:
                continue
            written = min(shared, other.prefilled)
            usable = self.reusable(other.cached_tokens, written)
            if usable > reused:
                reused, source = usable, other.slot
            if usable == written:  # the rest is still being written (unless a ring has lost its first positions)
                coming = max(coming, shared)
        if coming > reused:
            return None
        return slot, reused, source

    def reusable(self, held: int, shared: int) -> int:
        """Of a slot that wrote `held` positions, how many of the `shared` leading ones a new request can reuse:
        all, unless a ring has lost some of them (then only all `held` together, else none)."""
        if self.ring is None or held <= self.ring or shared == held:
            return shared
        return 0

    def borrow(self) -> int:
        """A free slot to write scratch positions into (it stays free, and keeps nothing)."""
        slot = self.free_slots[0]
        self.kept[slot] = []
        return slot

    def release(self, request: Request, keep: list[int]) -> None:
        """The request ends; its slot, if it held one, keeps the K/V of `keep` (its leading tokens)."""
        if request.status is Status.RUNNING:
            del self.running[request.slot]
            self.kept[request.slot] = keep if self.prefix_caching else []
            self.free_slots.append(request.slot)  # the most recently used
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.slot = None

    def decoding(self) -> list[Request]:
        """Running requests in slot order."""
        return [self.running[slot] for slot in sorted(self.running)]

    def slot_states(self) -> list[SlotState]:
        """Every slot, in order."""
        states = []
        for slot in range(len(self.kept)):
            request = self.running.get(slot)
            if request is None:
                states.append(SlotState(slot, "free", 0, len(self.kept[slot])))
            else:
                state = "decode" if request.output_ids else "prefill"
                states.append(SlotState(slot, state, request.cached_tokens, 0, request.request_id))
        return states

    @property
    def kept_lengths(self) -> list[int]:
        """Tokens each free slot holds for reuse."""
        return [len(self.kept[slot]) for slot in self.free_slots]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]: bisect on list equality, which runs in C
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
