//! The service's part in record locks (`rackfs_locks::record`): freeing what a mount whose
//! session ended left in the files' tables.
//!
//! When a session ends, its lock client slot stays dead for the lock trees' `dead_for` before
//! it is reused (see [`crate::locktree`]). For that long the service frees every entry of that
//! client in the tables that existed when it died (the only ones it could reach), each time it
//! ticks, so entries its queued verbs still land are freed too. A table mutex the client holds
//! is freed once half of that time has passed, when its queued verbs have landed; until then
//! lock operations on that file wait. Each table changed gets its version bumped, so waiters
//! look again.
//!
//! **After a take-over** the new primary starts with every table empty (the old sessions and
//! their locks are gone) and holds every table's mutex ([`GRACE`]) for a grace period, in
//! which mounts that followed it reclaim the locks their processes hold ([`reclaim`]); only
//! then may anyone take a new lock ([`end_grace`]). A reclaim the table contradicts (it
//! conflicts with another one) is refused and that lock lost, which the mount logs.

use std::time::Duration;

use rackfs_locks::record::{
    client_of, encode_slot, entry_offset, holder, ENTRIES, INFO, MUTEX, VERSION,
};
use rackfs_verbs::Region;

use crate::storage::Storage;

struct Sweep {
    client: u16,
    tables: Vec<u64>,
    died: Duration,
    until: Duration,
}

/// Sweeps of dead clients' record locks in progress.
#[derive(Default)]
pub struct RecordLockSweeps {
    sweeps: Vec<Sweep>,
}

impl RecordLockSweeps {
    /// Client `client` died at `now`; its locks in `tables` are freed until `now + window`.
    pub fn start(&mut self, client: u16, tables: Vec<u64>, now: Duration, window: Duration) {
        self.sweeps.push(Sweep {
            client,
            tables,
            died: now,
            until: now + window,
        });
    }

    pub fn tick(&mut self, st: &dyn Storage) {
        if self.sweeps.is_empty() {
            return;
        }
        let now = st.elapsed();
        let region = st.local().1;
        for s in &self.sweeps {
            let free_mutex = now >= s.died + (s.until - s.died) / 2;
            for &at in &s.tables {
                sweep(region, at, s.client, free_mutex);
            }
        }
        self.sweeps.retain(|s| now < s.until);
    }
}

/// Frees `client`'s entries in the table at `at` (and its hold on the mutex if `free_mutex`);
/// returns the entries freed.
pub fn sweep(region: &Region, at: u64, client: u16, free_mutex: bool) -> u64 {
    let mut freed = 0;
    for i in 0..ENTRIES {
        let info_at = at + entry_offset(i) + INFO;
        let info = region.load(info_at).expect("table in region");
        if client_of(info) == Some(client) {
            region.store(info_at, 0).expect("table in region");
            freed += 1;
        }
    }
    let mut changed = freed > 0;
    if free_mutex {
        let h = holder(client);
        // Failing (the node's atomics go through its NIC, whose loopback failed: logged), the
        // mutex is freed at the next sweep of the window.
        changed |= owner_cas(region, at + MUTEX, h, 0) == Some(h);
    }
    if changed {
        bump(region, at);
    }
    freed
}

/// Zeroes every table (a primary that took over: every lock of the old primary's sessions
/// went with them).
pub fn clear(region: &Region, tables: &[(u64, u64)]) {
    let zeros = vec![0u8; rackfs_locks::record::TABLE_LEN as usize];
    for &(_, at) in tables {
        region.write(at, &zeros).expect("table in region");
    }
}

/// The mutex value of a table whose locks are being reclaimed (a primary that took over, in
/// its grace period): no mount can take the mutex until the service gives it back.
pub const GRACE: u64 = u64::MAX;

/// Holds every table for the grace period (a store atomic with mounts' remote CAS on the
/// mutex: see [`Region::store_shared`]).
pub fn begin_grace(region: &Region, tables: &[(u64, u64)]) {
    for &(_, at) in tables {
        if let Err(e) = region.store_shared(at + MUTEX, GRACE) {
            tracing::warn!(table = at, error = %e, "a record-lock table could not be held for the grace period");
        }
    }
}

/// Gives every table back to the mounts after the grace period; false if one could not be
/// (the caller tries again).
pub fn end_grace(region: &Region, tables: &[(u64, u64)]) -> bool {
    let mut all = true;
    for &(_, at) in tables {
        match owner_cas(region, at + MUTEX, GRACE, 0) {
            Some(GRACE) => bump(region, at),
            Some(_) => {}
            None => all = false,
        }
    }
    all
}

/// The node's own compare-and-swap of a table word; `None` (logged) when it failed, which only
/// a node whose atomics go through its NIC sees (see [`Region::compare_swap`]).
fn owner_cas(region: &Region, at: u64, old: u64, new: u64) -> Option<u64> {
    match region.compare_swap(at, old, new) {
        Ok(found) => Some(found),
        Err(e) => {
            tracing::warn!(offset = at, error = %e, "a record-lock table word could not be changed");
            None
        }
    }
}

/// Enters the locks `client` reclaims into the table at `at` (held for the grace period);
/// returns those another reclaim already contradicts, which are not entered.
pub fn reclaim(
    region: &Region,
    at: u64,
    client: u16,
    locks: &[rackfs_proto::namespace::ReclaimedLock],
) -> Vec<rackfs_proto::namespace::ReclaimedLock> {
    use rackfs_locks::record::{decode, plan, Mode, Want, TABLE_LEN};
    let mut bytes = vec![0u8; (TABLE_LEN - entry_offset(0)) as usize];
    region
        .read(at + entry_offset(0), &mut bytes)
        .expect("table in region");
    let mut slots = decode(&bytes);
    let mut refused = Vec::new();
    for l in locks {
        let w = Want {
            client,
            host: l.host,
            owner: l.owner,
            pid: l.pid,
            start: l.start,
            end: l.end,
            mode: if l.exclusive {
                Mode::Exclusive
            } else {
                Mode::Shared
            },
        };
        match plan(&slots, &w) {
            Ok(writes) => {
                for (i, e) in writes {
                    region
                        .write(at + entry_offset(i), &encode_slot(e))
                        .expect("table in region");
                    slots[i] = e;
                }
            }
            Err(_) => refused.push(*l),
        }
    }
    bump(region, at);
    refused
}

fn bump(region: &Region, at: u64) {
    let mut v = region.load(at + VERSION).expect("table in region");
    loop {
        match owner_cas(region, at + VERSION, v, v + 1) {
            Some(was) if was == v => break,
            Some(was) => v = was,
            None => break,
        }
    }
}
