//! The in-flight cap that the runs of a sweep share: one slot per job in flight, served first
//! come, first served.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// The shared slots: how many are taken, and the runs (by their ticket) waiting for one.
pub(super) struct Slots {
    cap: usize,
    state: Mutex<SlotState>,
    freed: Condvar,
}

#[derive(Default)]
struct SlotState {
    used: usize,
    /// Runs waiting for a slot, in the order they first asked.
    waiting: VecDeque<u64>,
    next_ticket: u64,
}

impl Slots {
    pub(super) fn new(cap: usize) -> Slots {
        Slots {
            cap: cap.max(1),
            state: Mutex::new(SlotState::default()),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A ticket for a new run.
    pub(super) fn ticket(&self) -> u64 {
        let mut s = self.lock();
        s.next_ticket += 1;
        s.next_ticket
    }

    /// Takes a slot for `ticket` if one is free for it: free slots go to the runs waiting
    /// longest, so one is free for `ticket` when more are free than runs wait ahead of it.
    /// Otherwise `ticket` waits (keeping its place) and this is false.
    pub(super) fn try_take(&self, ticket: u64) -> bool {
        let mut s = self.lock();
        let ahead = s
            .waiting
            .iter()
            .position(|&t| t == ticket)
            .unwrap_or(s.waiting.len());
        if s.used + ahead < self.cap {
            s.used += 1;
            s.waiting.retain(|&t| t != ticket);
            true
        } else {
            if !s.waiting.contains(&ticket) {
                s.waiting.push_back(ticket);
            }
            false
        }
    }

    /// Takes a slot even over the cap: a job adopted from an earlier start is in flight already.
    pub(super) fn take_anyway(&self) {
        self.lock().used += 1;
    }

    /// Gives `n` slots back and wakes the runs waiting.
    pub(super) fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut s = self.lock();
        s.used = s.used.saturating_sub(n);
        drop(s);
        self.freed.notify_all();
    }

    /// `ticket` no longer waits (its run ended).
    pub(super) fn leave(&self, ticket: u64) {
        self.lock().waiting.retain(|&t| t != ticket);
        self.freed.notify_all();
    }

    /// Sleeps until a slot is given back, at most `timeout`.
    pub(super) fn wait(&self, timeout: Duration) {
        let s = self.lock();
        let _ = self.freed.wait_timeout(s, timeout);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared cap holds across runs; a slot given back goes to the run that has waited
    /// longest, not to the one that asks again first (a deep backlog does not starve the
    /// others); a run that leaves gives up its place.
    #[test]
    fn shared_slots_are_capped_and_served_first_come_first_served() {
        let slots = Slots::new(2);
        let (deep, a, b) = (slots.ticket(), slots.ticket(), slots.ticket());
        assert!(slots.try_take(deep));
        assert!(slots.try_take(deep));
        assert!(!slots.try_take(deep), "over the cap");
        assert!(!slots.try_take(a));
        assert!(!slots.try_take(b));
        slots.give_back(1);
        // `deep` was refused before `a` and `b` were: its turn.
        assert!(slots.try_take(deep), "deep queued first: its turn");
        assert!(!slots.try_take(deep), "and now it waits behind a and b");
        slots.give_back(1);
        assert!(!slots.try_take(deep), "a waits longer");
        assert!(!slots.try_take(b), "a waits longer");
        assert!(slots.try_take(a));
        slots.give_back(1);
        assert!(!slots.try_take(deep), "b waits longer");
        assert!(slots.try_take(b));
        slots.give_back(2);
        // Two free slots, `deep` alone waiting: it takes both.
        assert!(slots.try_take(deep));
        assert!(slots.try_take(deep));
        // An adopted job counts over the cap; a run that leaves is no longer waited for.
        slots.take_anyway();
        assert!(!slots.try_take(a));
        slots.leave(a);
        slots.give_back(3);
        assert!(slots.try_take(b), "a left: b is first");
        assert!(slots.try_take(b));
        assert!(!slots.try_take(b));
    }
}
