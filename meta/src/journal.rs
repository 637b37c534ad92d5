//! The primary's namespace changes, as a standby replays them.
//!
//! The namespace is a deterministic function of the [`Step`]s applied to it and of what
//! [`Storage`] answered while they ran: it keeps ordered maps only, reads no clock and no
//! mount-written word except through `Storage`. So a standby that applies the same steps in
//! the same order, handing back every answer the primary's storage gave ([`Replay`]), holds
//! the same namespace and writes the same bytes at the same offsets of its metadata area.
//! Side effects on data nodes (allocating, freeing, copying stripes) happened once, under the
//! primary; the replay only returns their answers. Lock trees are not journaled: a primary
//! that takes over starts them afresh.
//!
//! Mount-written words (a record's size and mtime) reach the standby where the service reads
//! them through [`Storage::load`]: when a file is released, truncated or trimmed, and when a
//! session ends. A size written since then by a mount that still has the file open is
//! reported again by that mount to the primary that takes over.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use rackfs_proto::control::{ControlResponse, ErrorCode, FsStat, Resolved};
use rackfs_proto::namespace::MetaRequest;
use rackfs_proto::Refusal;
use rackfs_verbs::Region;
use serde::{Deserialize, Serialize};

use crate::file::Dropped;
use crate::{Namespace, Storage};

/// One change of the namespace, as the primary applied it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Step {
    /// A namespace request of a client session (only those that change something).
    Handle { session: u64, req: MetaRequest },
    /// A client session ended: its opens are released.
    EndSession { session: u64 },
    /// Session `to` takes over fenced session `from`'s opens.
    Adopt { from: u64, to: u64 },
    /// A data node was declared dead: its replicas are dropped.
    DropNode { node: u32 },
    /// A degraded stripe is copied back towards its replication factor.
    Rebuild { ino: u64, stripe: u64 },
    /// This primary took over: last stripes are not trimmed until the mounts' sizes settle,
    /// and its serials continue past any its predecessor used unjournaled.
    TakeOver,
    /// Every mount that wrote under the old primary has reported its sizes: trims resume.
    SizesSettled,
    /// A primary that took over follows what data node `node` holds now.
    RollForward { node: u32 },
}

/// What a step returned.
#[derive(Debug)]
pub enum Outcome {
    Response(ControlResponse),
    Dropped(Dropped),
    Rebuilt(Result<u64, Refusal>),
    RolledForward(crate::namespace::RolledForward),
    Done,
}

impl Step {
    /// Whether a namespace request changes anything (only those are journaled).
    pub fn changes(req: &MetaRequest) -> bool {
        let req = req.inner();
        !(Step::only_reads(req)
            || matches!(
                req,
                MetaRequest::StatFs
                    | MetaRequest::LockSlot
                    | MetaRequest::LockTree { .. }
                    | MetaRequest::ReclaimLocks { .. }
                    | MetaRequest::Retry { .. }
            ))
    }

    /// Whether a namespace request is answered from the namespace alone, touching nothing
    /// else (no other node, no lock tree, no session state).
    pub fn only_reads(req: &MetaRequest) -> bool {
        matches!(
            req.inner(),
            MetaRequest::Lookup { .. }
                | MetaRequest::GetAttr { .. }
                | MetaRequest::ReadDir { .. }
                | MetaRequest::ReadDirPlus { .. }
                | MetaRequest::ReadLink { .. }
                | MetaRequest::GetStripe { .. }
                | MetaRequest::GetXattr { .. }
                | MetaRequest::ListXattr { .. }
                | MetaRequest::SizeAtTakeOver { .. }
        )
    }

    /// Applies the step to `ns`: the one place both the primary and a standby run it.
    pub fn run(self, ns: &mut Namespace, st: &dyn Storage) -> Outcome {
        match self {
            Step::Handle { session, req } => Outcome::Response(ns.handle(session, req, st)),
            Step::EndSession { session } => {
                ns.end_session(session, st);
                Outcome::Done
            }
            Step::Adopt { from, to } => {
                ns.adopt(from, to);
                Outcome::Done
            }
            Step::DropNode { node } => Outcome::Dropped(ns.drop_node(node, st)),
            Step::Rebuild { ino, stripe } => Outcome::Rebuilt(ns.rebuild(ino, stripe, st)),
            Step::TakeOver => {
                ns.take_over();
                Outcome::Done
            }
            Step::SizesSettled => {
                ns.sizes_settled();
                Outcome::Done
            }
            Step::RollForward { node } => Outcome::RolledForward(ns.roll_forward(node, st)),
        }
    }
}

/// What one [`Storage`] call answered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Nodes(Vec<u32>),
    Count(u64),
    Offset(Result<u64, Refusal>),
    Done(Result<(), Refusal>),
    Domain(Option<String>),
    Stat(FsStat),
    Time(u64),
    Elapsed(Duration),
    Word(u64),
    Resolved(Result<Resolved, Refusal>),
    Offsets(Result<Vec<u64>, Refusal>),
}

/// A step with the answers its storage gave, numbered in the primary's order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    /// The primary's node id (what `Storage::local` named).
    pub primary: u32,
    pub step: Step,
    pub answers: Vec<Answer>,
}

/// A [`Storage`] that passes every call to the primary's and keeps the answers.
pub struct Recorder<'a> {
    inner: &'a dyn Storage,
    answers: Mutex<Vec<Answer>>,
}

impl<'a> Recorder<'a> {
    pub fn new(inner: &'a dyn Storage) -> Recorder<'a> {
        Recorder {
            inner,
            answers: Mutex::default(),
        }
    }

    pub fn into_answers(self) -> Vec<Answer> {
        self.answers.into_inner().expect("answers lock")
    }

    fn keep<T>(&self, v: T, as_answer: impl FnOnce(&T) -> Answer) -> T {
        self.answers
            .lock()
            .expect("answers lock")
            .push(as_answer(&v));
        v
    }
}

impl Storage for Recorder<'_> {
    fn data_nodes(&self) -> Vec<u32> {
        self.keep(self.inner.data_nodes(), |v| Answer::Nodes(v.clone()))
    }
    fn cluster_size(&self) -> usize {
        self.keep(self.inner.cluster_size(), |&n| Answer::Count(n as u64))
    }
    fn alloc(&self, node: u32, len: u64, tag: Option<u64>) -> Result<u64, Refusal> {
        self.keep(self.inner.alloc(node, len, tag), |r| {
            Answer::Offset(r.clone())
        })
    }
    fn alloc_many(&self, node: u32, len: u64, tags: &[u64]) -> Result<Vec<u64>, Refusal> {
        self.keep(self.inner.alloc_many(node, len, tags), |r| {
            Answer::Offsets(r.clone())
        })
    }
    fn free(&self, node: u32, offset: u64, tag: Option<u64>) -> Result<(), Refusal> {
        self.keep(self.inner.free(node, offset, tag), |r| {
            Answer::Done(r.clone())
        })
    }
    fn resize(
        &self,
        node: u32,
        offset: u64,
        len: u64,
        tag: u64,
        expect: u64,
    ) -> Result<u64, Refusal> {
        self.keep(self.inner.resize(node, offset, len, tag, expect), |r| {
            Answer::Offset(r.clone())
        })
    }
    fn zero(&self, node: u32, offset: u64, len: u64, expect: u64) -> Result<(), Refusal> {
        self.keep(self.inner.zero(node, offset, len, expect), |r| {
            Answer::Done(r.clone())
        })
    }
    fn retag(&self, node: u32, offset: u64, expect: u64, tag: u64) -> Result<(), Refusal> {
        self.keep(self.inner.retag(node, offset, expect, tag), |r| {
            Answer::Done(r.clone())
        })
    }
    fn copy(
        &self,
        src: u32,
        from: u64,
        expect: u64,
        dst: u32,
        to: u64,
        len: u64,
    ) -> Result<(), Refusal> {
        self.keep(self.inner.copy(src, from, expect, dst, to, len), |r| {
            Answer::Done(r.clone())
        })
    }
    fn resolve(&self, node: u32, extents: &[(u64, u64)]) -> Result<Resolved, Refusal> {
        self.keep(self.inner.resolve(node, extents), |r| {
            Answer::Resolved(r.clone())
        })
    }
    fn domain(&self, node: u32) -> Option<String> {
        self.keep(self.inner.domain(node), |d| Answer::Domain(d.clone()))
    }
    fn local(&self) -> (u32, &Region) {
        self.inner.local()
    }
    fn meta_alloc(&self, len: u64) -> Result<u64, Refusal> {
        self.keep(self.inner.meta_alloc(len), |r| Answer::Offset(r.clone()))
    }
    fn meta_free(&self, offset: u64, len: u64) {
        self.inner.meta_free(offset, len)
    }
    fn load(&self, offset: u64) -> u64 {
        self.keep(self.inner.load(offset), |&w| Answer::Word(w))
    }
    fn fs_stat(&self) -> FsStat {
        self.keep(self.inner.fs_stat(), |s| Answer::Stat(s.clone()))
    }
    fn wall_ns(&self) -> u64 {
        self.keep(self.inner.wall_ns(), |&t| Answer::Time(t))
    }
    fn elapsed(&self) -> Duration {
        self.keep(self.inner.elapsed(), |&d| Answer::Elapsed(d))
    }
}

/// A [`Storage`] that hands back a journal entry's answers in order, over the standby's own
/// region. Data nodes are not touched; a word a mount wrote is written into the region as the
/// primary read it. The first answer that does not fit the call is kept as the divergence.
pub struct Replay<'a> {
    primary: u32,
    region: &'a Region,
    answers: Mutex<VecDeque<Answer>>,
    diverged: Mutex<Option<String>>,
}

impl<'a> Replay<'a> {
    pub fn new(primary: u32, region: &'a Region, answers: Vec<Answer>) -> Replay<'a> {
        Replay {
            primary,
            region,
            answers: Mutex::new(answers.into()),
            diverged: Mutex::default(),
        }
    }

    /// Why the replay did not follow the primary's run, if it did not (answers asked for and
    /// not there, of another kind, or left over).
    pub fn divergence(self) -> Option<String> {
        let left = self.answers.into_inner().expect("answers lock").len();
        let d = self.diverged.into_inner().expect("diverged lock");
        d.or_else(|| (left > 0).then(|| format!("{left} answers left over")))
    }

    fn next<T>(&self, call: &str, take: impl FnOnce(Answer) -> Option<T>, or: T) -> T {
        let a = self.answers.lock().expect("answers lock").pop_front();
        // Described only if it does not fit (a clone is cheap, formatting every answer not).
        let got = a.clone();
        match a.and_then(take) {
            Some(v) => v,
            None => {
                let mut d = self.diverged.lock().expect("diverged lock");
                d.get_or_insert_with(|| format!("{call} was answered {got:?}"));
                or
            }
        }
    }

    /// [`Replay::next`] for a call that may fail: a diverged replay answers it with a refusal.
    fn fallible<T>(
        &self,
        call: &str,
        take: impl FnOnce(Answer) -> Option<Result<T, Refusal>>,
    ) -> Result<T, Refusal> {
        let or = Err(Refusal::new(ErrorCode::Internal, "replay diverged"));
        self.next(call, take, or)
    }

    fn offset(&self, call: &str) -> Result<u64, Refusal> {
        self.fallible(call, |a| match a {
            Answer::Offset(r) => Some(r),
            _ => None,
        })
    }

    fn done(&self, call: &str) -> Result<(), Refusal> {
        self.fallible(call, |a| match a {
            Answer::Done(r) => Some(r),
            _ => None,
        })
    }
}

impl Storage for Replay<'_> {
    fn data_nodes(&self) -> Vec<u32> {
        let take = |a| {
            if let Answer::Nodes(v) = a {
                Some(v)
            } else {
                None
            }
        };
        self.next("data_nodes", take, Vec::new())
    }
    fn cluster_size(&self) -> usize {
        let take = |a| {
            if let Answer::Count(n) = a {
                Some(n as usize)
            } else {
                None
            }
        };
        self.next("cluster_size", take, 1)
    }
    fn alloc(&self, _: u32, _: u64, _: Option<u64>) -> Result<u64, Refusal> {
        self.offset("alloc")
    }
    fn alloc_many(&self, _: u32, _: u64, _: &[u64]) -> Result<Vec<u64>, Refusal> {
        self.fallible("alloc_many", |a| match a {
            Answer::Offsets(r) => Some(r),
            _ => None,
        })
    }
    fn free(&self, _: u32, _: u64, _: Option<u64>) -> Result<(), Refusal> {
        self.done("free")
    }
    fn resize(&self, _: u32, _: u64, _: u64, _: u64, _: u64) -> Result<u64, Refusal> {
        self.offset("resize")
    }
    fn zero(&self, _: u32, _: u64, _: u64, _: u64) -> Result<(), Refusal> {
        self.done("zero")
    }
    fn retag(&self, _: u32, _: u64, _: u64, _: u64) -> Result<(), Refusal> {
        self.done("retag")
    }
    fn copy(&self, _: u32, _: u64, _: u64, _: u32, _: u64, _: u64) -> Result<(), Refusal> {
        self.done("copy")
    }
    fn resolve(&self, _: u32, _: &[(u64, u64)]) -> Result<Resolved, Refusal> {
        self.fallible("resolve", |a| match a {
            Answer::Resolved(r) => Some(r),
            _ => None,
        })
    }
    fn domain(&self, _: u32) -> Option<String> {
        let take = |a| {
            if let Answer::Domain(d) = a {
                Some(d)
            } else {
                None
            }
        };
        self.next("domain", take, None)
    }
    fn local(&self) -> (u32, &Region) {
        (self.primary, self.region)
    }
    fn meta_alloc(&self, _: u64) -> Result<u64, Refusal> {
        self.offset("meta_alloc")
    }
    fn meta_free(&self, offset: u64, len: u64) {
        let _ = self.region.discard(offset, len);
    }
    fn load(&self, offset: u64) -> u64 {
        let take = |a| {
            if let Answer::Word(w) = a {
                Some(w)
            } else {
                None
            }
        };
        let w = self.next("load", take, 0);
        // The primary's region held this word when it ran the step (a mount wrote it).
        let _ = self.region.store(offset, w);
        w
    }
    fn fs_stat(&self) -> FsStat {
        let take = |a| {
            if let Answer::Stat(s) = a {
                Some(s)
            } else {
                None
            }
        };
        self.next("fs_stat", take, FsStat::default())
    }
    fn wall_ns(&self) -> u64 {
        let take = |a| {
            if let Answer::Time(t) = a {
                Some(t)
            } else {
                None
            }
        };
        self.next("wall_ns", take, 0)
    }
    fn elapsed(&self) -> Duration {
        let take = |a| {
            if let Answer::Elapsed(d) = a {
                Some(d)
            } else {
                None
            }
        };
        self.next("elapsed", take, Duration::ZERO)
    }
}

/// Applies one journal entry to a standby's namespace over its own region, returning what
/// the step answered; an error says how the replay diverged from the primary's run (the
/// standby is then out of sync).
pub fn replay(ns: &mut Namespace, region: &Region, entry: Entry) -> Result<Outcome, String> {
    let r = Replay::new(entry.primary, region, entry.answers);
    let out = entry.step.run(ns, &r);
    ns.take_deleted();
    match r.divergence() {
        None => Ok(out),
        Some(why) => Err(format!("journal entry {}: {why}", entry.seq)),
    }
}

/// The last changes each client session made (up to [`Answered::KEPT`]), with their answers,
/// as a standby replayed them or the primary made them: a primary (the same, or one that took
/// over) answers a mount's retry of one ([`MetaRequest::Retry`]) from here. Several threads of a mount may have had a change in
/// flight when the primary died.
///
/// A session's answers outlive its end (for the last [`Answered::ENDED`] sessions that
/// ended): a mount that gave up on a slow primary and continues on the same one in a new
/// session drops its old connection, which ends the old session, before it retries there.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Answered {
    kept: BTreeMap<u64, VecDeque<(MetaRequest, ControlResponse)>>,
    /// Sessions that ended with answers kept, oldest first.
    ended: VecDeque<u64>,
}

impl Answered {
    /// Changes kept per session.
    pub const KEPT: usize = 64;
    /// Ended sessions whose answers are kept.
    pub const ENDED: usize = 256;

    /// Notes what a replayed step answered.
    pub fn note(&mut self, step: &Step, out: &Outcome) {
        match (step, out) {
            (Step::Handle { session, req }, Outcome::Response(resp)) => {
                self.keep(*session, req.clone(), resp.clone())
            }
            (Step::EndSession { session }, _) => self.end(*session),
            _ => {}
        }
    }

    /// Keeps what session `session`'s change `req` was answered.
    pub fn keep(&mut self, session: u64, req: MetaRequest, resp: ControlResponse) {
        let kept = self.kept.entry(session).or_default();
        if kept.len() == Self::KEPT {
            kept.pop_front();
        }
        kept.push_back((req, resp));
    }

    /// Session `session` ended: its answers go once [`Answered::ENDED`] sessions ended after
    /// it.
    pub fn end(&mut self, session: u64) {
        if !self.kept.contains_key(&session) || self.ended.contains(&session) {
            return;
        }
        self.ended.push_back(session);
        while self.ended.len() > Self::ENDED {
            if let Some(old) = self.ended.pop_front() {
                self.kept.remove(&old);
            }
        }
    }

    /// The answer to `req` if session `from` made it lately (the newest such). An unnumbered
    /// request's answer is taken (answered once: an equal request later is a new one); a
    /// numbered one's stays, as the mount may have to ask again after another failover.
    pub fn take(&mut self, from: u64, req: &MetaRequest) -> Option<ControlResponse> {
        let kept = self.kept.get_mut(&from)?;
        let at = kept.iter().rposition(|(r, _)| r == req)?;
        match req {
            MetaRequest::Numbered { .. } => Some(kept[at].1.clone()),
            _ => kept.remove(at).map(|(_, resp)| resp),
        }
    }
}
