//! The numbers in a client's queue entry names, reused.
//!
//! etcd keeps a deleted key in its index until the next compaction, and a
//! read of a range walks every key the range had since: a waiter's join
//! reads its line's range, so a line whose entries all had new names slowed
//! every join by each wait since the last compaction (256 waiters on one
//! key handed off 230 times a second on a fresh line, 63 to 80 with 100,000
//! earlier waits behind it; etcd does not compact by default). A client
//! names its entries `<session lease>-<slot>` and takes the lowest free
//! slot, so a line has at most as many names as waiters at once, for as
//! long as the session lives.
//!
//! A name is reused only once its entry is known deleted and no request
//! that names it can still be applied: a late put would come back under
//! someone else's wait, and a late delete would take the new entry (each
//! delete names the place it deletes, see [`crate::txn::dequeue`], and
//! attempts whose outcome is unknown retire the name). So a [`Slot`] is
//! given back only by [`Slot::free`], which the waiter calls once its
//! entry's delete was answered; a slot dropped otherwise is retired, its
//! number never used again by this client.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

/// A client's entry numbers: the free ones, and the next never used.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Numbers given back, lowest first.
    free: BinaryHeap<Reverse<u64>>,
    /// The lowest number never handed out.
    next: u64,
}

impl Slots {
    /// The lowest free number, held until it is freed or retired.
    pub(crate) fn take(self: &Arc<Self>) -> Slot {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let number = match state.free.pop() {
            Some(Reverse(number)) => number,
            None => {
                state.next += 1;
                state.next - 1
            }
        };
        Slot {
            number,
            slots: Arc::downgrade(self),
        }
    }

    /// How many numbers were ever handed out (the most entry names a
    /// client's lines have had).
    #[cfg(test)]
    pub(crate) fn handed_out(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).next
    }
}

/// One entry number, held by one waiter. Dropped, it is retired.
#[derive(Debug)]
pub(crate) struct Slot {
    number: u64,
    slots: std::sync::Weak<Slots>,
}

impl Slot {
    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    /// Gives the number back for another entry: its entry is known deleted
    /// and nothing sent that names it can be applied any more.
    pub(crate) fn free(self) {
        if let Some(slots) = self.slots.upgrade() {
            slots
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .free
                .push(Reverse(self.number));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_numbers_are_reused_lowest_first_and_dropped_ones_never() {
        let slots = Arc::new(Slots::default());
        let (a, b, c) = (slots.take(), slots.take(), slots.take());
        assert_eq!((a.number(), b.number(), c.number()), (0, 1, 2));
        c.free();
        a.free();
        drop(b);
        assert_eq!(slots.take().number(), 0);
        assert_eq!(slots.take().number(), 2);
        assert_eq!(slots.take().number(), 3, "a retired number came back");
        assert_eq!(slots.handed_out(), 4);
    }
}
