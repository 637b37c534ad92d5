//! The primary's view of the data nodes' membership by epoch: a data node is live while the
//! coordinator shows it registered under the lease (its epoch) it was admitted under; the
//! primary gives a node data only while it is live.

use std::collections::HashMap;

use rackfs_clock::Mutex;
use rackfs_coord::LeaseId;

/// The primary's view of the data nodes' membership: the epoch each was admitted under, and the
/// epochs the coordinator showed at its last look. A node is live while the two agree.
#[derive(Default)]
pub struct Epochs(Mutex<EpochState>);

#[derive(Default)]
struct EpochState {
    admitted: HashMap<u32, LeaseId>,
    registered: HashMap<u32, LeaseId>,
}

impl Epochs {
    /// Whether node `id` holds the lease it was admitted under (as last seen).
    pub fn is_live(&self, id: u32) -> bool {
        let s = self.0.lock().expect("epochs lock");
        s.admitted
            .get(&id)
            .is_some_and(|e| s.registered.get(&id) == Some(e))
    }

    /// The epoch node `id` was admitted under.
    pub fn admitted(&self, id: u32) -> Option<LeaseId> {
        self.0
            .lock()
            .expect("epochs lock")
            .admitted
            .get(&id)
            .copied()
    }

    /// Takes the coordinator's current members; returns the admitted nodes no longer live.
    pub fn refresh(&self, registered: Vec<(u32, LeaseId)>) -> Vec<u32> {
        let mut s = self.0.lock().expect("epochs lock");
        s.registered = registered.into_iter().collect();
        let s = &*s;
        s.admitted
            .iter()
            .filter(|(id, e)| s.registered.get(id) != Some(e))
            .map(|(&id, _)| id)
            .collect()
    }

    /// Node `id` is admitted under `epoch`, which the coordinator shows it registered under.
    pub fn admit(&self, id: u32, epoch: LeaseId) {
        let mut s = self.0.lock().expect("epochs lock");
        s.admitted.insert(id, epoch);
        s.registered.insert(id, epoch);
    }

    /// Node `id` joined again, empty: it is not admitted until it asks under a new epoch.
    pub fn forget(&self, id: u32) {
        self.0.lock().expect("epochs lock").admitted.remove(&id);
    }
}
