//! The RackFS metadata service as a library: no sockets, no threads, no clock of its own.
//!
//! Each part owns its state: [`Namespace`] (directories, inodes, file records and extent
//! tables), [`LockTrees`] (the files' Citron lock trees and the mounts' lock slots) and
//! [`placement::ClusterQos`] (admission and pShift placement). [`MetaService`] composes the
//! first two behind the namespace RPC. Everything the service needs from its node goes through
//! [`Storage`]: the daemon implements it over its allocator and peers, [`MemStorage`] in
//! process for tests, so the service runs under property tests and under simulation alike.
//! The caller serialises calls (one `&mut` at a time).

pub mod file;
pub mod history;
pub mod journal;
pub mod locktree;
pub mod namespace;
pub mod placement;
pub mod pool;
pub mod recordlocks;
pub mod storage;
pub mod xattr;

use std::collections::HashMap;
use std::time::Duration;

use rackfs_proto::control::{ControlResponse, ErrorCode};
use rackfs_proto::locktree::TreeWord;
use rackfs_proto::namespace::{Change, MetaRequest};
use rackfs_proto::record::REC_LOCKS;
use rackfs_proto::Refusal;

pub use file::Dropped;
use journal::Recorder;
pub use journal::{Entry, Outcome, Step};
pub use locktree::LockTrees;
pub use namespace::Namespace;
pub use storage::{MemStorage, Storage};

/// The namespace and the lock-tree service, answering [`MetaRequest`]s.
pub struct MetaService {
    pub namespace: Namespace,
    pub locks: LockTrees,
    /// Freeing the record locks of mounts whose sessions ended.
    record_locks: recordlocks::RecordLockSweeps,
    /// Until when mounts may reclaim record locks (a primary that took over).
    record_grace: Option<Duration>,
    /// Changes other mounts must forget, since [`MetaService::take_changes`] last ran.
    changes: Vec<Change>,
    /// Whether namespace changes are journaled (a standby follows this service).
    journaling: bool,
    /// The last journal entry's number.
    seq: u64,
    /// Entries made since [`MetaService::take_journal`] last ran.
    journal: Vec<Entry>,
    /// The old primary's last answer per session (a primary that took over; see
    /// [`MetaRequest::Retry`]).
    answered: journal::Answered,
    /// Each file's size as the mirror held it at take-over (see
    /// [`MetaRequest::SizeAtTakeOver`]).
    sizes_at_take_over: HashMap<u64, u64>,
}

impl MetaService {
    /// An empty filesystem whose root was made at `now_ns` (ns since the epoch);
    /// `lock_grace`: how long retired lock trees and the lock slots of ended sessions are kept
    /// (see [`locktree`]).
    pub fn new(lock_grace: Duration, now_ns: u64) -> MetaService {
        Self::over(Namespace::new(now_ns), lock_grace, 0)
    }

    /// The service over `namespace`, whose journal is at entry `seq` (a standby taking over:
    /// its lock trees start afresh).
    pub fn over(namespace: Namespace, lock_grace: Duration, seq: u64) -> MetaService {
        MetaService {
            namespace,
            locks: LockTrees::new(lock_grace, lock_grace),
            record_locks: Default::default(),
            record_grace: None,
            changes: Vec::new(),
            journaling: false,
            seq,
            journal: Vec::new(),
            answered: Default::default(),
            sizes_at_take_over: HashMap::new(),
        }
    }

    /// A standby taking over, before anyone writes to its region: keeps each file's size as
    /// its mirror holds it, which is what the old primary had journaled (see
    /// [`MetaRequest::SizeAtTakeOver`]), and holds trims until the mounts' sizes settle (see
    /// [`Step::TakeOver`]).
    pub fn take_over(&mut self, st: &dyn Storage) {
        self.sizes_at_take_over = self.namespace.file_sizes(st.local().1);
        self.step(Step::TakeOver, st);
    }

    /// Every mount that wrote under the old primary has reported its sizes by now: forgets
    /// the sizes [`MetaService::take_over`] kept and trims again.
    pub fn sizes_settled(&mut self, st: &dyn Storage) {
        self.sizes_at_take_over = HashMap::new();
        self.step(Step::SizesSettled, st);
    }

    /// Starts the files' lock trees afresh on a standby taking over (see
    /// [`LockTrees::clear_words`]).
    pub fn forget_old_lock_trees(&mut self, st: &dyn Storage) {
        let words = self.namespace.file_records().into_iter();
        self.locks.clear_words(st, words.map(|r| r + REC_LOCKS));
    }

    /// What the old primary answered last per session, as the standby replayed it: retries
    /// of those changes are answered from it.
    /// What was answered last per session (a new standby's snapshot carries it).
    pub fn answered(&self) -> &journal::Answered {
        &self.answered
    }

    pub fn set_answered(&mut self, answered: journal::Answered) {
        self.answered = answered;
    }

    /// Starts or stops journaling namespace changes (a standby is or is no longer following);
    /// returns the last entry's number, the point a standby's snapshot stands at.
    pub fn set_journaling(&mut self, on: bool) -> u64 {
        self.journaling = on;
        self.journal.clear();
        self.seq
    }

    /// The number of the last step run (the journal's position).
    pub fn journal_seq(&self) -> u64 {
        self.seq
    }

    /// The journal entries made since the last call, in order.
    pub fn take_journal(&mut self) -> Vec<Entry> {
        std::mem::take(&mut self.journal)
    }

    /// Runs one namespace step, journaling it with its storage's answers when a standby
    /// follows.
    fn step(&mut self, step: Step, st: &dyn Storage) -> Outcome {
        self.seq += 1;
        if !self.journaling {
            return step.run(&mut self.namespace, st);
        }
        let rec = Recorder::new(st);
        let out = step.clone().run(&mut self.namespace, &rec);
        self.journal.push(Entry {
            seq: self.seq,
            primary: st.local().0,
            step,
            answers: rec.into_answers(),
        });
        out
    }

    /// The namespace changes made since the last call (see [`Namespace::changes_of`]).
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// Handles one request on behalf of client session `session`.
    pub fn handle(&mut self, session: u64, req: MetaRequest, st: &dyn Storage) -> ControlResponse {
        let resp = match req {
            MetaRequest::LockSlot => self
                .locks
                .attach(session)
                .map_or_else(ControlResponse::from, ControlResponse::LockSlot),
            MetaRequest::ReclaimLocks { ino, locks } => self
                .reclaim_locks(session, ino, &locks, st)
                .map_or_else(ControlResponse::from, |()| ControlResponse::Ok),
            MetaRequest::LockTree { ino, old, units } => self
                .publish_tree(ino, old, units, st)
                .map_or_else(ControlResponse::from, |w| ControlResponse::LockTree(w.0)),
            MetaRequest::SizeAtTakeOver { ino } => {
                ControlResponse::SizeAtTakeOver(self.sizes_at_take_over.get(&ino).copied())
            }
            MetaRequest::Retry { from, req } => {
                // A retry wraps the retries of earlier sessions, one per failover: each
                // session it went through may have made it and kept the answer.
                let mut froms = vec![from];
                let mut inner = *req;
                while let MetaRequest::Retry { from, req } = inner {
                    froms.push(from);
                    inner = *req;
                }
                match froms.iter().find_map(|&f| self.answered.take(f, &inner)) {
                    Some(resp) => resp,
                    None => return self.handle(session, inner, st),
                }
            }
            MetaRequest::Numbered { req, .. } if !Step::changes(&req) => {
                return self.handle(session, *req, st)
            }
            other if !Step::changes(&other) => self.namespace.handle(session, other, st),
            other => {
                let changes = self.namespace.changes_of(other.inner());
                let lock_units = match *other.inner() {
                    MetaRequest::CreateOpen { lock_units, .. } => lock_units,
                    _ => 0,
                };
                // Kept as a standby keeps what it replays: a mount whose call timed out asks
                // again as a retry (`MetaRequest::Retry`), here or on the primary after it,
                // and gets this answer instead of the change made twice.
                let kept = other.clone();
                let step = Step::Handle {
                    session,
                    req: other,
                };
                let Outcome::Response(mut resp) = self.step(step, st) else {
                    unreachable!("a request step answers a response")
                };
                self.answered.keep(session, kept, resp.clone());
                if !matches!(resp, ControlResponse::Error { .. }) {
                    self.changes.extend(changes);
                }
                if let (ControlResponse::Created(c), 1..) = (&mut resp, lock_units) {
                    // Lock trees are not journaled (a primary that takes over starts afresh).
                    match self.publish_tree(c.attr.ino, 0, lock_units, st) {
                        Ok(w) => c.lock_tree = w.0,
                        Err(e) => {
                            tracing::debug!(ino = c.attr.ino, error = %e, "no lock tree at create")
                        }
                    }
                }
                resp
            }
        };
        self.retire_deleted(st);
        resp
    }

    /// A client session was fenced: its lock slot is watched as dead (its range locks are
    /// recovered, its record locks freed); its opens stay until it ends or a new session
    /// adopts them.
    pub fn fence_session(&mut self, session: u64, st: &dyn Storage) {
        self.end_lock_client(session, st);
    }

    fn end_lock_client(&mut self, session: u64, st: &dyn Storage) {
        if let Some(client) = self.locks.end_session(session, st) {
            let tables = self.namespace.record_lock_tables();
            let tables = tables.into_iter().map(|(_, at)| at).collect();
            let window = self.locks.dead_for();
            self.record_locks
                .start(client, tables, st.elapsed(), window);
        }
    }

    /// A primary that took over: the old sessions' record locks went with them; for `grace`
    /// only the mounts that held them may enter them again ([`MetaRequest::ReclaimLocks`]).
    pub fn take_over_record_locks(&mut self, st: &dyn Storage, grace: Duration) {
        let tables = self.namespace.record_lock_tables();
        recordlocks::clear(st.local().1, &tables);
        recordlocks::begin_grace(st.local().1, &tables);
        self.record_grace = Some(st.elapsed() + grace);
    }

    fn reclaim_locks(
        &mut self,
        session: u64,
        ino: u64,
        locks: &[rackfs_proto::namespace::ReclaimedLock],
        st: &dyn Storage,
    ) -> Result<(), Refusal> {
        if self.record_grace.is_none() {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                "no grace period for reclaiming locks (this primary did not just take over, or                  its grace period is over)",
            ));
        }
        let client = self.locks.attach(session)?;
        let Some(&(_, at)) = self
            .namespace
            .record_lock_tables()
            .iter()
            .find(|(i, _)| *i == ino)
        else {
            return Err(Refusal::new(
                ErrorCode::NotFound,
                format!("inode {ino} has no record-lock table to reclaim locks in"),
            ));
        };
        let lost = recordlocks::reclaim(st.local().1, at, client, locks);
        if lost.is_empty() {
            return Ok(());
        }
        Err(Refusal::new(
            ErrorCode::Invalid,
            format!(
                "{} of {} locks on inode {ino} conflict with others reclaimed: {lost:?}",
                lost.len(),
                locks.len()
            ),
        ))
    }

    /// Session `to` takes over the opens of fenced session `from`.
    pub fn adopt(&mut self, from: u64, to: u64, st: &dyn Storage) {
        self.step(Step::Adopt { from, to }, st);
    }

    /// A client session ended (its mount went away): its opens are released and its lock slot
    /// is watched as dead.
    pub fn end_session(&mut self, session: u64, st: &dyn Storage) {
        self.end_lock_client(session, st);
        self.step(Step::EndSession { session }, st);
        self.answered.end(session);
        self.retire_deleted(st);
    }

    /// Data node `node` was declared dead: its replicas are dropped from every stripe that
    /// has another (see [`Namespace::drop_node`]).
    pub fn drop_node(&mut self, node: u32, st: &dyn Storage) -> Dropped {
        match self.step(Step::DropNode { node }, st) {
            Outcome::Dropped(d) => d,
            _ => unreachable!("a drop step answers what it dropped"),
        }
    }

    /// A primary that took over: its tables follow what data node `node` holds now (see
    /// [`Namespace::roll_forward`]).
    pub fn roll_forward(&mut self, node: u32, st: &dyn Storage) -> namespace::RolledForward {
        match self.step(Step::RollForward { node }, st) {
            Outcome::RolledForward(r) => r,
            _ => unreachable!("a roll-forward step answers what it did"),
        }
    }

    /// Copies a degraded stripe back towards its replication factor (see
    /// [`Namespace::rebuild`]); returns the bytes copied.
    pub fn rebuild(&mut self, ino: u64, stripe: u64, st: &dyn Storage) -> Result<u64, Refusal> {
        match self.step(Step::Rebuild { ino, stripe }, st) {
            Outcome::Rebuilt(r) => r,
            _ => unreachable!("a rebuild step answers what it copied"),
        }
    }

    /// Lock-tree recovery and reaping; call every millisecond or so.
    pub fn tick(&mut self, st: &dyn Storage) {
        self.locks.tick(st);
        self.record_locks.tick(st);
        // Tried again at the next tick if a table could not be given back.
        if self.record_grace.is_some_and(|until| st.elapsed() >= until)
            && recordlocks::end_grace(st.local().1, &self.namespace.record_lock_tables())
        {
            self.record_grace = None;
        }
    }

    fn publish_tree(
        &mut self,
        ino: u64,
        old: u64,
        units: u64,
        st: &dyn Storage,
    ) -> Result<TreeWord, Refusal> {
        let record = self.namespace.record(ino)?;
        self.locks
            .publish(st, ino, record + REC_LOCKS, TreeWord(old), units)
    }

    fn retire_deleted(&mut self, st: &dyn Storage) {
        for ino in self.namespace.take_deleted() {
            self.locks.forget(st, ino);
        }
    }
}
