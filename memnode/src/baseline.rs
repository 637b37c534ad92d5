//! The CPU range-lock server that benchmarks measure Citron against: every lock operation is
//! an RPC answered by the node's CPU. Served only by nodes started with
//! `--baseline-lock-server`; a production node refuses its RPCs.

use std::collections::HashMap;

use rackfs_clock::{Bell, Mutex};

use rackfs_proto::control::ErrorCode;
use rackfs_proto::Refusal;

/// Held ranges by lock space: `(l, r, session)`.
type RangeTable = HashMap<u64, Vec<(u64, u64, u64)>>;

/// Held ranges, and a condition variable for waiters.
#[derive(Default)]
pub struct BaselineLocks {
    held: Mutex<RangeTable>,
    freed: Bell,
}

impl BaselineLocks {
    /// Locks units `[l, r)` of `space` for `session`, waiting while an overlapping range is held.
    pub fn lock(&self, session: u64, space: u64, l: u64, r: u64) -> Result<(), Refusal> {
        if l >= r {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!("empty range [{l}, {r})"),
            ));
        }
        let mut t = self.held.lock().expect("range locks");
        while t
            .get(&space)
            .is_some_and(|v| v.iter().any(|&(a, b, _)| a < r && l < b))
        {
            t = self.freed.wait(t);
        }
        t.entry(space).or_default().push((l, r, session));
        Ok(())
    }

    /// Releases `[l, r)` of `space`, which `session` must hold.
    pub fn unlock(&self, session: u64, space: u64, l: u64, r: u64) -> Result<(), Refusal> {
        let mut t = self.held.lock().expect("range locks");
        let held = t.get_mut(&space).and_then(|v| {
            let i = v
                .iter()
                .position(|&(a, b, s)| (a, b, s) == (l, r, session))?;
            Some(v.swap_remove(i))
        });
        drop(t);
        match held {
            Some(_) => {
                self.freed.notify_all();
                Ok(())
            }
            None => Err(Refusal::new(
                ErrorCode::NotFound,
                format!("[{l}, {r}) of space {space} is not held by this session"),
            )),
        }
    }

    /// Releases everything a session held.
    pub fn end_session(&self, session: u64) {
        for v in self.held.lock().expect("range locks").values_mut() {
            v.retain(|e| e.2 != session);
        }
        self.freed.notify_all();
    }
}
