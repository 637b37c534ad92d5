//! The primary's frees of stripe extents on other data nodes, queued here and sent by the
//! change that released them before it is answered (`Node::with_meta`: a mount reading a
//! stripe it still caches must find the tag gone, not the old bytes), else by a thread of
//! their own. Only tagged frees wait here: a node frees an extent only if it still carries the
//! owner tag, so a free that arrives late (after the node came back empty under a new epoch,
//! say) frees nothing it should not. Reading free space (`statfs`) sends every waiting free
//! first.

use std::collections::VecDeque;
use std::time::Duration;

use rackfs_clock::{Bell, Mutex};

/// An extent to free: (node, offset, owner tag).
pub type Free = (u32, u64, u64);

/// Frees waiting to be sent.
#[derive(Default)]
pub struct Frees {
    queue: Mutex<VecDeque<Free>>,
    queued: Bell,
    /// Held while frees taken from the queue are being sent, so that one who sends the rest
    /// returns only once those are done too.
    sending: Mutex<()>,
}

impl Frees {
    pub fn push(&self, f: Free) {
        self.queue.lock().expect("frees lock").push_back(f);
        self.queued.notify_one();
    }

    /// Sends every waiting free with `send`, all at once (so one request per node can carry
    /// them); returns once every free queued before the call was sent (by this caller or by
    /// another one sending meanwhile).
    pub fn send(&self, send: impl FnOnce(Vec<Free>)) {
        let _sending = self.sending.lock().expect("frees sending lock");
        let taken: Vec<Free> = self.queue.lock().expect("frees lock").drain(..).collect();
        if !taken.is_empty() {
            send(taken);
        }
    }

    /// Blocks until a free is queued or `max` passed.
    pub fn wait(&self, max: Duration) {
        let q = self.queue.lock().expect("frees lock");
        if q.is_empty() {
            drop(self.queued.wait_timeout(q, max));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frees_are_taken_in_order_and_once() {
        let f = Frees::default();
        f.push((1, 64, 7));
        f.push((2, 128, 8));
        f.wait(Duration::from_secs(5));
        let sent = Mutex::new(Vec::new());
        f.send(|x| sent.lock().unwrap().extend(x));
        f.send(|x| sent.lock().unwrap().extend(x));
        assert_eq!(*sent.lock().unwrap(), vec![(1, 64, 7), (2, 128, 8)]);
    }
}
