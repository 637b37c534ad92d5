//! `fcntl` record locks and `flock` of one file on one mount, kept in the file's record-lock
//! table on the primary (`rackfs_locks::record`), so they hold across every mount.
//!
//! The kernel hands a lock request over with its owner (a process's file table for `fcntl`,
//! an open file for `flock`), the caller's pid and an inclusive range. A request that must
//! wait (`F_SETLKW`, `flock` without `LOCK_NB`) is retried whenever the table's version
//! changes, on a thread of its own so that the FUSE workers stay free for the holders' unlocks;
//! the wait ends with `EINTR` as soon as the waiting thread has a signal to take.
//!
//! Locks belong to the mount's session: a mount that is fenced (lease expired) loses them (the
//! service frees them; this module logs it). When the primary fails over, the mount reclaims
//! what its processes hold from the new one, in its grace period ([`FileRecordLocks::reclaim`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rackfs_locks::record::{Entry, Mode, RecordLockError, RecordLockTable, Refused, Want};
use rackfs_proto::control::ControlResponse;
use rackfs_proto::namespace::{MetaRequest, ReclaimedLock};
use rackfs_verbs::{block_on, RemoteAddr};

use crate::cluster::Cluster;

/// How long a lock operation waits for the table's mutex (held by a mount that stopped or
/// died inside a change until the service frees it) before failing with `ENOLCK`.
const MUTEX_PATIENCE: Duration = Duration::from_secs(20);
/// Longest pause between two looks of a waiting request at the table.
const MAX_POLL: Duration = Duration::from_millis(10);

/// The kernel's `OFFSET_MAX`: "to the end of file and beyond" in an inclusive range.
const OFFSET_MAX: u64 = i64::MAX as u64;

/// This host, as record-lock entries name it (14 bits of the boot id), so `F_GETLK` reports
/// the pid of a holder on this host only.
fn host() -> u16 {
    static HOST: OnceLock<u16> = OnceLock::new();
    *HOST.get_or_init(|| {
        let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let h = id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        (h & 0x3fff) as u16
    })
}

/// A lock request as the kernel states it.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub owner: u64,
    pub pid: u32,
    pub start: u64,
    /// Inclusive; `i64::MAX` (the kernel's `OFFSET_MAX`) for "to the end of file and beyond".
    pub end: u64,
    /// `F_RDLCK`, `F_WRLCK` or `F_UNLCK`.
    pub typ: i32,
}

impl Request {
    pub fn new(owner: u64, pid: u32, start: u64, end: u64, typ: i32) -> Request {
        Request {
            owner,
            pid,
            start,
            end,
            typ,
        }
    }
}

/// A conflicting lock as `F_GETLK` reports it: inclusive range, type, pid (0 for a holder on
/// another host).
pub type Conflict = (u64, u64, i32, u32);

/// A table handle and the session, failover count and primary it was made under.
struct Handle {
    session: u64,
    failovers: u64,
    node: u32,
    table: Arc<RecordLockTable>,
}

/// The record locks of one file on this mount.
pub struct FileRecordLocks {
    ino: u64,
    /// The table handle, for the session it was made in.
    table: Mutex<Option<Handle>>,
    /// Owners that may hold locks here, by the open file (FUSE handle) they locked through:
    /// only their closes cost a round trip. A close (flush) drops a process's locks; the last
    /// close of an open file (release) drops the locks still recorded against it, which can
    /// only be those owned by the open file itself (`flock`, OFD locks).
    owners: Mutex<HashMap<u64, HashSet<u64>>>,
    /// What each owner holds, as the table said after its last change: reclaimed from a
    /// primary that takes over.
    held: Mutex<HashMap<u64, Vec<Entry>>>,
}

impl FileRecordLocks {
    pub fn new(ino: u64) -> FileRecordLocks {
        FileRecordLocks {
            ino,
            table: Mutex::new(None),
            owners: Mutex::new(HashMap::new()),
            held: Mutex::new(HashMap::new()),
        }
    }

    /// The table, asked of the primary on first use and again in a new session.
    fn table(&self, cl: &Cluster) -> Result<(Arc<RecordLockTable>, u32), i32> {
        let mut cur = self.table.lock().expect("record lock table");
        let session = cl.session();
        if let Some(h) = cur.as_ref() {
            if h.session == session {
                return Ok((h.table.clone(), h.node));
            }
            // Fenced (not a failover, whose locks are reclaimed): the locks are gone.
            if h.failovers == cl.failovers() {
                if !std::mem::take(&mut *self.held.lock().expect("held")).is_empty() {
                    tracing::warn!(
                        ino = self.ino,
                        "this mount's session was fenced: the record locks its processes held \
                         on the file are gone"
                    );
                }
                self.owners.lock().expect("owners").clear();
            }
        }
        let failovers = cl.failovers();
        let at = match cl.meta(MetaRequest::RecordLocks { ino: self.ino }) {
            Ok(ControlResponse::RecordLocks(at)) => at,
            Ok(_) => return Err(libc::EIO),
            Err(e) => return Err(e.errno()),
        };
        let (slot, _, session) = cl.lock_client()?;
        let node = cl.primary_id();
        let p = cl
            .node_in(node, session)
            .map_err(|e| cl.verbs_errno(node, &e))?;
        let table = Arc::new(RecordLockTable::new(
            p.qp.clone(),
            RemoteAddr::new(p.rkey, at),
            slot,
            MUTEX_PATIENCE,
        ));
        *cur = Some(Handle {
            session,
            failovers,
            node,
            table: table.clone(),
        });
        Ok((table, node))
    }

    /// Runs `op` on the table; once more if it failed because the primary died and another
    /// took over meanwhile (whose table this mount's locks were reclaimed into).
    fn on_table<T>(
        &self,
        cl: &Cluster,
        op: impl Fn(&RecordLockTable) -> Result<T, RecordLockError>,
    ) -> Result<T, i32> {
        let before = cl.failovers();
        let (t, node) = self.table(cl)?;
        match op(&t) {
            Ok(v) => Ok(v),
            Err(RecordLockError::Verbs(e)) => {
                let errno = cl.verbs_errno(node, &e);
                if !cl.primary_replaced(before) {
                    tracing::warn!(ino = self.ino, node, error = %e, "record lock operation failed");
                    return Err(errno);
                }
                let (t, _) = self.table(cl)?;
                op(&t).map_err(|e| self.failed(e))
            }
            Err(e) => Err(self.failed(e)),
        }
    }

    fn failed(&self, e: RecordLockError) -> i32 {
        tracing::warn!(ino = self.ino, error = %e, "record lock operation failed");
        match e {
            RecordLockError::Busy { .. } => libc::ENOLCK,
            RecordLockError::Verbs(_) => libc::EIO,
        }
    }

    fn want(&self, client: u16, r: &Request, mode: Mode) -> Want {
        Want {
            client,
            host: host(),
            owner: r.owner,
            pid: r.pid,
            start: r.start,
            end: if r.end >= OFFSET_MAX {
                u64::MAX
            } else {
                r.end + 1
            },
            mode,
        }
    }

    fn mode(typ: i32) -> Result<Mode, i32> {
        match typ {
            libc::F_RDLCK => Ok(Mode::Shared),
            libc::F_WRLCK => Ok(Mode::Exclusive),
            libc::F_UNLCK => Ok(Mode::Unlock),
            _ => Err(libc::EINVAL),
        }
    }

    /// `F_GETLK`: the first lock of another owner that conflicts with `r`.
    pub fn test(&self, cl: &Cluster, r: &Request) -> Result<Option<Conflict>, i32> {
        let mode = Self::mode(r.typ)?;
        let found = self.on_table(cl, |t| block_on(t.test(&self.want(t.client(), r, mode))))?;
        Ok(found.map(|e: Entry| {
            let end = if e.end == u64::MAX {
                OFFSET_MAX
            } else {
                e.end - 1
            };
            let typ = if e.exclusive {
                libc::F_WRLCK
            } else {
                libc::F_RDLCK
            };
            (e.start, end, typ, if e.host == host() { e.pid } else { 0 })
        }))
    }

    /// Sets or clears `r`, asked through open file `fh`, once: `Ok(false)` if another
    /// owner's lock conflicts.
    pub fn try_set(&self, cl: &Cluster, fh: u64, r: &Request) -> Result<bool, i32> {
        let mode = Self::mode(r.typ)?;
        let res = self.on_table(cl, |t| block_on(t.apply(&self.want(t.client(), r, mode))))?;
        match res {
            Ok(holding) => {
                if mode != Mode::Unlock {
                    let mut owners = self.owners.lock().expect("owners");
                    owners.entry(fh).or_default().insert(r.owner);
                }
                let mut held = self.held.lock().expect("held");
                if holding.is_empty() {
                    held.remove(&r.owner);
                } else {
                    held.insert(r.owner, holding);
                }
                Ok(true)
            }
            Err(Refused::Conflict(_)) => Ok(false),
            Err(Refused::Full) => {
                tracing::warn!(
                    ino = self.ino,
                    "the file's record-lock table is full: ENOLCK"
                );
                Err(libc::ENOLCK)
            }
        }
    }

    /// `F_SETLKW`: sets `r`, waiting while another owner's lock conflicts; `EINTR` once
    /// `interrupted` says so.
    pub fn set_waiting(
        &self,
        cl: &Cluster,
        fh: u64,
        r: &Request,
        interrupted: impl Fn() -> bool,
    ) -> Result<(), i32> {
        let version = || self.on_table(cl, |t| block_on(t.version()));
        loop {
            let seen = version()?;
            if self.try_set(cl, fh, r)? {
                return Ok(());
            }
            let mut pause = Duration::from_micros(50);
            loop {
                if interrupted() {
                    return Err(libc::EINTR);
                }
                cl.clock().sleep(pause);
                pause = (pause * 2).min(MAX_POLL);
                if version()? != seen {
                    break;
                }
            }
        }
    }

    /// This mount continues on a primary that took over (which starts with no locks): asserts
    /// the locks its processes hold on the file there again, within its grace period.
    pub fn reclaim(&self, cl: &Cluster) {
        let locks: Vec<ReclaimedLock> = self
            .held
            .lock()
            .expect("held")
            .values()
            .flatten()
            .map(|e| ReclaimedLock {
                owner: e.owner,
                pid: e.pid,
                host: e.host,
                start: e.start,
                end: e.end,
                exclusive: e.exclusive,
            })
            .collect();
        // The next lock operation makes a handle for the new session.
        *self.table.lock().expect("record lock table") = None;
        if locks.is_empty() {
            return;
        }
        // A lock slot, so a lease: the reclaimed locks are the new session's.
        let res = cl
            .lock_client()
            .map_err(|e| format!("no lock slot: errno {e}"))
            .and_then(|_| {
                let req = MetaRequest::ReclaimLocks {
                    ino: self.ino,
                    locks: locks.clone(),
                };
                cl.primary()
                    .meta(req)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            });
        match res {
            Ok(()) => tracing::info!(
                ino = self.ino,
                locks = locks.len(),
                "record locks reclaimed from the primary that took over"
            ),
            Err(why) => {
                tracing::warn!(ino = self.ino, %why, "record locks of this mount's processes on the file were lost in the failover");
                self.held.lock().expect("held").clear();
                self.owners.lock().expect("owners").clear();
            }
        }
    }

    /// A close by a process (`flush`): drops every lock of `owner` on the file (POSIX drops a
    /// process's locks on a file at any close of it).
    pub fn closed_by(&self, cl: &Cluster, owner: u64) -> Result<(), i32> {
        let held = {
            let mut owners = self.owners.lock().expect("owners");
            owners
                .values_mut()
                .fold(false, |held, set| set.remove(&owner) | held)
        };
        if held {
            self.drop_owner(cl, owner)?;
        }
        Ok(())
    }

    /// The last close of open file `fh` (`release`): drops the locks still recorded against
    /// it (a `flock`, OFD locks).
    pub fn released(&self, cl: &Cluster, fh: u64) -> Result<(), i32> {
        let owners = self.owners.lock().expect("owners").remove(&fh);
        for owner in owners.into_iter().flatten() {
            self.drop_owner(cl, owner)?;
        }
        Ok(())
    }

    fn drop_owner(&self, cl: &Cluster, owner: u64) -> Result<(), i32> {
        let r = Request::new(owner, 0, 0, OFFSET_MAX, libc::F_UNLCK);
        self.try_set(cl, 0, &r).map(|_| ())
    }
}

/// Whether thread `tid` of process `pid` has a signal to take (or is gone): a waiting lock
/// request then ends with `EINTR`.
pub fn signal_pending(pid: u32, tid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .or_else(|_| std::fs::read_to_string(format!("/proc/{tid}/status")));
    let Ok(status) = status else {
        return true;
    };
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let pending = field("SigPnd:") | field("ShdPnd:");
    pending & !field("SigBlk:") & !field("SigIgn:") != 0
}
