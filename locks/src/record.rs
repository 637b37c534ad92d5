//! POSIX record locks (`fcntl` `F_SETLK`/`F_SETLKW`/`F_GETLK`, and `flock`) shared by every
//! mount of a cluster, on one-sided verbs: a per-file table in the primary's region, changed
//! only under the table's mutex word, so an uncontended lock or unlock costs two round trips
//! and no memory-node CPU.
//!
//! Remote memory of a table ([`TABLE_LEN`] bytes, from its base): the header — `mutex`
//! ([`MUTEX`]) and `version` ([`VERSION`]) — then [`ENTRIES`] entries of [`ENTRY_LEN`] bytes,
//! `start, end, owner, info` (`end` exclusive, `u64::MAX` for "to the end of file and beyond";
//! `info` is [`Entry::info`], 0 for a free entry). Who writes which word:
//! * `mutex`: a client takes it by compare-and-swap from 0 to its holder value (its client
//!   slot plus one) and gives it back by writing 0, in the batch that writes its changes;
//!   the metadata service frees it, for a client whose session ended, once that client's
//!   queued verbs can no longer land;
//! * entries: a client changes, under the mutex, only entries that are free or are its own
//!   (its client slot), and never moves another client's entry; the service frees the
//!   entries of clients whose sessions ended (without the mutex: no live client writes them);
//! * `version`: incremented (fetch-and-add) by whoever changed entries, after the change;
//!   waiters poll it instead of the table.
//!
//! So the table is a sequential structure: every decision is made on a snapshot read under
//! the mutex. A client killed in the middle of its batch leaves only its own entries torn,
//! and those are freed with its session. Granting is not fair (as with Linux's local locks, a
//! waiter retries when the table changes, and a newcomer may get in first).
//!
//! POSIX semantics ([`plan`]): a lock conflicts with another owner's overlapping lock unless
//! both are shared; setting or clearing a range replaces the owner's own locks there (split,
//! merge and conversion as `fcntl(2)` describes), and an owner's locks stay merged: adjacent
//! or overlapping ranges of one mode are one entry.

use std::time::Duration;

use rackfs_verbs::{Batch, Clock, QueuePair, RemoteAddr, VerbsError};

/// The mutex word.
pub const MUTEX: u64 = 0;
/// The version word, bumped after every change of entries.
pub const VERSION: u64 = 8;
const HEADER: u64 = 64;
/// Bytes of one entry.
pub const ENTRY_LEN: u64 = 32;
/// Entries of a table: the most locks (maximal ranges of one owner and mode) one file holds.
pub const ENTRIES: usize = 126;
/// Bytes of a table.
pub const TABLE_LEN: u64 = HEADER + ENTRIES as u64 * ENTRY_LEN;

const USED: u64 = 1 << 63;
const EXCLUSIVE: u64 = 1 << 62;

/// Offset of entry `i` from the table's base.
pub fn entry_offset(i: usize) -> u64 {
    HEADER + i as u64 * ENTRY_LEN
}

/// Offset of the `info` word within an entry: zero means the entry is free.
pub const INFO: u64 = 24;

/// The bytes of an entry slot: the entry's, or zeros for a free one.
pub fn encode_slot(e: Option<Entry>) -> [u8; ENTRY_LEN as usize] {
    e.map_or([0u8; ENTRY_LEN as usize], |e| e.encode())
}

/// The client slot whose entry an `info` word belongs to (`None`: a free entry).
pub fn client_of(info: u64) -> Option<u16> {
    (info & USED != 0).then_some((info >> 32) as u16)
}

/// The mutex value of client `client`.
pub fn holder(client: u16) -> u64 {
    client as u64 + 1
}

/// One held lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub start: u64,
    /// Exclusive; `u64::MAX`: to the end of file and beyond.
    pub end: u64,
    /// The lock owner the kernel names (a process's file table, or an open file for `flock`).
    pub owner: u64,
    pub exclusive: bool,
    /// The owning process, for `F_GETLK`.
    pub pid: u32,
    /// The host of the mount, so `F_GETLK` reports the pid only where it means something.
    pub host: u16,
    /// The mount's lock client slot.
    pub client: u16,
}

impl Entry {
    /// The `info` word: used, exclusive, host (14 bits), client slot, pid.
    pub fn info(&self) -> u64 {
        USED | if self.exclusive { EXCLUSIVE } else { 0 }
            | (self.host as u64 & 0x3fff) << 48
            | (self.client as u64) << 32
            | self.pid as u64
    }

    fn encode(&self) -> [u8; ENTRY_LEN as usize] {
        let mut b = [0u8; ENTRY_LEN as usize];
        for (i, w) in [self.start, self.end, self.owner, self.info()]
            .iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8]) -> Option<Entry> {
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let info = w(3);
        client_of(info).map(|client| Entry {
            start: w(0),
            end: w(1),
            owner: w(2),
            exclusive: info & EXCLUSIVE != 0,
            host: (info >> 48 & 0x3fff) as u16,
            client,
            pid: info as u32,
        })
    }

    fn same_owner(&self, w: &Want) -> bool {
        self.client == w.client && self.owner == w.owner
    }
}

/// Decodes a table's entries (as read from [`entry_offset`]`(0)`).
pub fn decode(entries: &[u8]) -> Vec<Option<Entry>> {
    entries
        .chunks_exact(ENTRY_LEN as usize)
        .map(Entry::decode)
        .collect()
}

/// What a request wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Shared,
    Exclusive,
    Unlock,
}

/// A lock request of one owner of one client for `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Want {
    pub client: u16,
    pub host: u16,
    pub owner: u64,
    pub pid: u32,
    pub start: u64,
    pub end: u64,
    pub mode: Mode,
}

/// Why a request cannot be granted now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Another owner holds this conflicting lock.
    Conflict(Entry),
    /// The table has no room for the owner's locks (ENOLCK).
    Full,
}

/// The lowest-starting lock of another owner that conflicts with `w` (`F_GETLK`), if any.
pub fn first_conflict(slots: &[Option<Entry>], w: &Want) -> Option<Entry> {
    if w.mode == Mode::Unlock {
        return None;
    }
    slots
        .iter()
        .flatten()
        .copied()
        .filter(|e| {
            !e.same_owner(w)
                && e.start < w.end
                && w.start < e.end
                && (e.exclusive || w.mode == Mode::Exclusive)
        })
        .min_by_key(|e| (e.start, e.end))
}

/// Entry writes: `(index, new content)`.
pub type Writes = Vec<(usize, Option<Entry>)>;

/// The entry writes that apply `w` to a table holding `slots`, in index order. Only the
/// owner's entries and free ones change.
pub fn plan(slots: &[Option<Entry>], w: &Want) -> Result<Writes, Refused> {
    plan_holding(slots, w).map(|(writes, _)| writes)
}

/// [`plan`], and the locks the owner holds once the writes are made.
pub fn plan_holding(slots: &[Option<Entry>], w: &Want) -> Result<(Writes, Vec<Entry>), Refused> {
    if let Some(e) = first_conflict(slots, w) {
        return Err(Refused::Conflict(e));
    }
    let mine: Vec<usize> = (0..slots.len())
        .filter(|&i| slots[i].is_some_and(|e| e.same_owner(w)))
        .collect();
    // The owner's locks cut to outside [start, end) (keeping their pids: an unlock names
    // none), then the new one, merged.
    let mut pieces: Vec<Entry> = Vec::new();
    for e in mine.iter().map(|&i| slots[i].expect("own entry")) {
        if e.start < w.start {
            pieces.push(Entry {
                end: e.end.min(w.start),
                ..e
            });
        }
        if e.end > w.end {
            pieces.push(Entry {
                start: e.start.max(w.end),
                ..e
            });
        }
    }
    if w.mode != Mode::Unlock {
        pieces.push(Entry {
            start: w.start,
            end: w.end,
            owner: w.owner,
            exclusive: w.mode == Mode::Exclusive,
            pid: w.pid,
            host: w.host,
            client: w.client,
        });
    }
    pieces.sort_by_key(|e| (e.start, e.end));
    let mut want: Vec<Entry> = Vec::new();
    for e in pieces {
        match want.last_mut() {
            Some(last) if last.exclusive == e.exclusive && e.start <= last.end => {
                last.end = last.end.max(e.end);
            }
            _ => want.push(e),
        }
    }
    // Keep the entries that stay as they are; reuse the owner's other entries, then free ones.
    let mut todo: Vec<Entry> = want
        .iter()
        .filter(|e| !mine.iter().any(|&i| slots[i] == Some(**e)))
        .copied()
        .collect();
    let mut writes = Vec::new();
    for &i in &mine {
        let e = slots[i].expect("own entry");
        if want.contains(&e) {
            continue;
        }
        writes.push((i, todo.pop()));
    }
    for (i, s) in slots.iter().enumerate() {
        if todo.is_empty() {
            break;
        }
        if s.is_none() {
            writes.push((i, todo.pop()));
        }
    }
    if !todo.is_empty() {
        return Err(Refused::Full);
    }
    writes.sort_by_key(|&(i, _)| i);
    Ok((writes, want))
}

/// Errors of the one-sided protocol.
#[derive(Debug, thiserror::Error)]
pub enum RecordLockError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// The mutex stayed taken past the patience (its holder stopped or died inside a change,
    /// and the service has not freed it yet).
    #[error("the record-lock table's mutex stayed held by {holder:#x} for {waited:?}")]
    Busy { holder: u64, waited: Duration },
}

/// One file's record-lock table as one client uses it.
pub struct RecordLockTable {
    qp: QueuePair,
    clock: Clock,
    base: RemoteAddr,
    client: u16,
    /// How long to wait for the mutex before giving up.
    patience: Duration,
}

impl RecordLockTable {
    pub fn new(qp: QueuePair, base: RemoteAddr, client: u16, patience: Duration) -> Self {
        let clock = qp.clock();
        RecordLockTable {
            qp,
            clock,
            base,
            client,
            patience,
        }
    }

    /// The client slot this handle locks as.
    pub fn client(&self) -> u16 {
        self.client
    }

    /// Takes the mutex and reads the entries (one round trip when the mutex is free).
    async fn hold(&self) -> Result<Vec<Option<Entry>>, RecordLockError> {
        let started = self.clock.now();
        let mut backoff = Duration::from_micros(5);
        loop {
            let mut b = Batch::new();
            let cas = b.cas(self.base.add(MUTEX), 0, holder(self.client));
            let read = b.read(self.base.add(entry_offset(0)), (TABLE_LEN - HEADER) as u32);
            let done = self.qp.post(b).await?;
            let was = done.value(cas)?;
            if was == 0 {
                return Ok(decode(done.data(read)?));
            }
            let waited = self.clock.now().saturating_sub(started);
            if waited > self.patience {
                return Err(RecordLockError::Busy {
                    holder: was,
                    waited,
                });
            }
            self.clock.sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(1));
        }
    }

    /// Writes `writes`, bumps the version if there were any, and gives the mutex back.
    async fn release(&self, writes: &[(usize, Option<Entry>)]) -> Result<(), RecordLockError> {
        let mut b = Batch::new();
        for (i, e) in writes {
            let bytes = encode_slot(*e);
            b.write_owned(self.base.add(entry_offset(*i)), bytes.to_vec());
        }
        if !writes.is_empty() {
            b.faa(self.base.add(VERSION), 1);
        }
        b.write_u64(self.base.add(MUTEX), 0);
        self.qp.post(b).await?;
        Ok(())
    }

    /// Applies `w` (set or clear a range) if nothing conflicts, returning what the owner then
    /// holds; `Ok(Err(..))` says why not.
    pub async fn apply(&self, w: &Want) -> Result<Result<Vec<Entry>, Refused>, RecordLockError> {
        let slots = self.hold().await?;
        match plan_holding(&slots, w) {
            Ok((writes, holding)) => {
                self.release(&writes).await?;
                Ok(Ok(holding))
            }
            Err(r) => {
                self.release(&[]).await?;
                Ok(Err(r))
            }
        }
    }

    /// The first lock of another owner that conflicts with `w` (`F_GETLK`).
    pub async fn test(&self, w: &Want) -> Result<Option<Entry>, RecordLockError> {
        let slots = self.hold().await?;
        let found = first_conflict(&slots, w);
        self.release(&[]).await?;
        Ok(found)
    }

    /// The table's version: it changes whenever a lock is set or cleared.
    pub async fn version(&self) -> Result<u64, RecordLockError> {
        let mut b = Batch::new();
        let v = b.read(self.base.add(VERSION), 8);
        let done = self.qp.post(b).await?;
        Ok(u64::from_le_bytes(
            done.data(v)?.try_into().expect("8 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(owner: u64, start: u64, end: u64, mode: Mode) -> Want {
        Want {
            client: 1,
            host: 7,
            owner,
            pid: 100 + owner as u32,
            start,
            end,
            mode,
        }
    }

    fn run(slots: &mut [Option<Entry>], w: Want) -> Result<(), Refused> {
        for (i, e) in plan(slots, &w)? {
            slots[i] = e;
        }
        Ok(())
    }

    fn held(slots: &[Option<Entry>], owner: u64) -> Vec<(u64, u64, bool)> {
        let mut v: Vec<_> = slots
            .iter()
            .flatten()
            .filter(|e| e.owner == owner)
            .map(|e| (e.start, e.end, e.exclusive))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn entries_round_trip() {
        let e = Entry {
            start: 5,
            end: u64::MAX,
            owner: 0xdead_beef_0000_0001,
            exclusive: true,
            pid: 4_000_000,
            host: 0x3fff,
            client: 1023,
        };
        assert_eq!(Entry::decode(&e.encode()), Some(e));
        assert_eq!(Entry::decode(&[0u8; 32]), None);
    }

    #[test]
    fn splits_merges_and_converts_an_owners_locks() {
        let mut s = vec![None; 8];
        run(&mut s, want(1, 0, 100, Mode::Exclusive)).unwrap();
        // Unlocking the middle splits the lock.
        run(&mut s, want(1, 40, 60, Mode::Unlock)).unwrap();
        assert_eq!(held(&s, 1), [(0, 40, true), (60, 100, true)]);
        // Relocking it merges the three back into one.
        run(&mut s, want(1, 40, 60, Mode::Exclusive)).unwrap();
        assert_eq!(held(&s, 1), [(0, 100, true)]);
        // Converting part to shared splits by mode; adjacent shared ranges merge.
        run(&mut s, want(1, 50, 70, Mode::Shared)).unwrap();
        run(&mut s, want(1, 70, 200, Mode::Shared)).unwrap();
        assert_eq!(held(&s, 1), [(0, 50, true), (50, 200, false)]);
        // Another owner may share the shared part, not the exclusive one.
        let conflict = run(&mut s, want(2, 40, 60, Mode::Shared));
        assert!(matches!(conflict, Err(Refused::Conflict(e)) if e.owner == 1 && e.exclusive));
        run(&mut s, want(2, 60, 300, Mode::Shared)).unwrap();
        // An upgrade conflicts with the other owner's shared lock.
        assert!(run(&mut s, want(1, 100, 101, Mode::Exclusive)).is_err());
        // Unlock everything of owner 1 (close): owner 2 keeps its lock.
        run(&mut s, want(1, 0, u64::MAX, Mode::Unlock)).unwrap();
        assert_eq!(held(&s, 1), []);
        assert_eq!(held(&s, 2), [(60, 300, false)]);
    }

    #[test]
    fn a_full_table_refuses_without_changing_anything() {
        let mut s = vec![None; 3];
        for k in 0..3 {
            run(&mut s, want(1, k * 10, k * 10 + 5, Mode::Exclusive)).unwrap();
        }
        let before = s.clone();
        assert_eq!(
            run(&mut s, want(1, 100, 105, Mode::Exclusive)),
            Err(Refused::Full)
        );
        assert_eq!(s, before);
        // Merging two into one frees an entry.
        run(&mut s, want(1, 0, 15, Mode::Exclusive)).unwrap();
        run(&mut s, want(1, 100, 105, Mode::Exclusive)).unwrap();
    }
}
