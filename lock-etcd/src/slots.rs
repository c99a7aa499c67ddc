//! The numbers in a client's key names, reused: its queue entries'
//! (`<session lease>-<slot>`, see [`crate::queue`]) and its permits'
//! (`<client>-<slot>`, see [`crate::permit_names`]).
//!
//! etcd keeps a deleted key in its index until the next compaction, and a
//! read of a range walks every key the range had since: a waiter's join
//! reads its line's range, and a permit attempt its semaphore's permits, so
//! a range whose keys all had new names slowed every such read by each key
//! it had since the last compaction (256 waiters on one key handed off 230
//! times a second on a fresh line, 63 to 80 with 100,000 earlier waits
//! behind it; 64 tasks on a semaphore of 3 went from 473 to 195
//! acquisitions a second within a minute; etcd does not compact by
//! default). A client takes the lowest free slot for each name, so a range
//! has at most as many of its names as it had keys at once.
//!
//! A name is reused only once no request that names it can still do harm
//! (see the modules that name keys this way); a [`Slot`] is given back only
//! by [`Slot::free`], and a slot dropped otherwise is retired, its number
//! never used again by this client.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

/// A client's name numbers: the free ones, and the next never used.
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

    /// How many numbers were ever handed out (the most names of this kind
    /// the client's ranges have had).
    #[cfg(test)]
    pub(crate) fn handed_out(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).next
    }
}

/// One name number, held by one queue entry or permit acquisition.
/// Dropped, it is retired.
#[derive(Debug)]
pub(crate) struct Slot {
    number: u64,
    slots: std::sync::Weak<Slots>,
}

impl Slot {
    pub(crate) fn number(&self) -> u64 {
        self.number
    }

    /// Gives the number back for another name: nothing sent that names it
    /// can do harm any more.
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

/// Whether `name` is `<hex>-<hex>` (lower case), as the slot names
/// distlock writes.
pub(crate) fn is_slot_name(name: &[u8]) -> bool {
    let hex = |part: &[u8]| {
        !part.is_empty()
            && part
                .iter()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    let mut parts = name.split(|b| *b == b'-');
    matches!((parts.next(), parts.next(), parts.next()), (Some(a), Some(b), None) if hex(a) && hex(b))
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
