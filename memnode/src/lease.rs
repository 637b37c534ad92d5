//! Lock-holder leases (primary only).
//!
//! A mount session that takes a lock client slot holds a lease from then on, renewed by the
//! mount ([`rackfs_proto::control::ControlRequest::Renew`], every quarter of the lease). A
//! session that has not renewed for the whole lease is *expired*: [`Leases::expire`] moves it to
//! the fenced set, once, and the node then fences it on every memory node and ends the session
//! (which recovers its range locks: see `rackfs_meta::locktree`). A fenced session stays fenced:
//! its requests and renewals are refused with [`ErrorCode::Fenced`] until its connection closes.
//! Leases are timed on the primary's clock; when the primary itself was paused for a while, every
//! lease restarts ([`Leases::restart_all`]) instead of expiring mounts that could not renew.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rackfs_proto::control::ErrorCode;
use rackfs_proto::Refusal;

/// Default lease of a lock holder.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(4);

#[derive(Default)]
struct State {
    /// Sessions holding a lease, with when it was last renewed.
    held: HashMap<u64, Instant>,
    fenced: HashSet<u64>,
}

/// The leases of the lock holders (see the module docs).
pub struct Leases {
    lease: Duration,
    state: Mutex<State>,
}

impl Leases {
    pub fn new(lease: Duration) -> Leases {
        Leases {
            lease,
            state: Mutex::default(),
        }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// `session` took a lock slot: its lease starts now (if it has none yet).
    pub fn hold(&self, session: u64) {
        let mut st = self.state.lock().expect("leases lock");
        if !st.fenced.contains(&session) {
            st.held.entry(session).or_insert_with(Instant::now);
        }
    }

    /// Renews `session`'s lease (a session without one has nothing to renew).
    pub fn renew(&self, session: u64) -> Result<Duration, Refusal> {
        let mut st = self.state.lock().expect("leases lock");
        if st.fenced.contains(&session) {
            return Err(fenced(session, self.lease));
        }
        if let Some(t) = st.held.get_mut(&session) {
            *t = Instant::now();
        }
        Ok(self.lease)
    }

    /// The refusal for a request of `session` if it is fenced.
    pub fn check(&self, session: u64) -> Result<(), Refusal> {
        if self
            .state
            .lock()
            .expect("leases lock")
            .fenced
            .contains(&session)
        {
            return Err(fenced(session, self.lease));
        }
        Ok(())
    }

    /// The session ended (its connection closed): it needs no lease any more.
    pub fn end(&self, session: u64) {
        let mut st = self.state.lock().expect("leases lock");
        st.held.remove(&session);
        st.fenced.remove(&session);
    }

    /// Restarts every lease at `now`: after this node itself was paused (stopped, starved), no
    /// mount could renew, so none is blamed for it.
    pub fn restart_all(&self, now: Instant) {
        for t in self.state.lock().expect("leases lock").held.values_mut() {
            *t = (*t).max(now);
        }
    }

    /// Sessions whose lease ran out by `now`: from now on they are fenced.
    pub fn expire(&self, now: Instant) -> Vec<u64> {
        let mut st = self.state.lock().expect("leases lock");
        let out: Vec<u64> = st
            .held
            .iter()
            .filter(|(_, &t)| now.saturating_duration_since(t) >= self.lease)
            .map(|(&s, _)| s)
            .collect();
        for s in &out {
            st.held.remove(s);
            st.fenced.insert(*s);
        }
        out
    }
}

fn fenced(session: u64, lease: Duration) -> Refusal {
    Refusal::new(
        ErrorCode::Fenced,
        format!(
            "this mount's session {session} did not renew its lock lease within {lease:?} and \
             was fenced: its range locks went to others and nothing it sent is executed any \
             more"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_expires_once_unless_renewed_and_fences_its_session() {
        let l = Leases::new(Duration::from_millis(100));
        l.hold(1);
        l.hold(2);
        let t0 = Instant::now();
        assert!(l.expire(t0).is_empty());
        l.renew(2).unwrap();
        let later = Instant::now() + Duration::from_millis(100);
        let mut gone = l.expire(later);
        gone.sort();
        assert_eq!(gone, vec![1, 2]);
        assert!(l.expire(later).is_empty(), "expired once");
        assert_eq!(l.renew(1).unwrap_err().code, ErrorCode::Fenced);
        assert_eq!(l.check(2).unwrap_err().code, ErrorCode::Fenced);
        l.hold(1);
        assert!(
            l.expire(later + Duration::from_secs(1)).is_empty(),
            "no new lease"
        );
        assert!(
            l.check(3).is_ok() && l.renew(3).is_ok(),
            "no lease, nothing to fence"
        );
        l.end(1);
        assert!(l.check(1).is_ok());
    }

    #[test]
    fn a_pause_of_the_primary_restarts_every_lease() {
        let l = Leases::new(Duration::from_millis(100));
        l.hold(1);
        let resumed = Instant::now() + Duration::from_secs(5);
        l.restart_all(resumed);
        assert!(l.expire(resumed + Duration::from_millis(99)).is_empty());
        assert_eq!(l.expire(resumed + Duration::from_millis(100)), vec![1]);
    }

    #[test]
    fn renewal_keeps_a_lease() {
        let l = Leases::new(Duration::from_millis(200));
        l.hold(7);
        std::thread::sleep(Duration::from_millis(120));
        l.renew(7).unwrap();
        assert!(l
            .expire(Instant::now() + Duration::from_millis(150))
            .is_empty());
        assert_eq!(
            l.expire(Instant::now() + Duration::from_millis(200)),
            vec![7]
        );
    }
}
