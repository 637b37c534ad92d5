//! What both sides of the metadata standby keep ([`Standby`]; the protocol and its invariant
//! are the `standby` module's): on the primary, the follower its journal goes to, queued under
//! the metadata lock ([`Standby::queue`]) and shipped by group commit before the changes are
//! answered ([`Standby::commit`]: several shipments in flight on the one connection, in
//! order), and the extents whose freeing waits for it; on a data node,
//! the snapshot coming in and the mirror the journal is replayed on,
//! writing the same bytes at the same offsets of its metadata area as the primary did.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use rackfs_clock::{Bell, Clock, Mutex, MutexGuard};
use rackfs_coord::{CoordError, Coordinator, Guard, Write};
use rackfs_meta::{journal, Entry, MetaService, Namespace};
use rackfs_proto::control::{ControlRequest, ControlResponse, ErrorCode};
use rackfs_proto::link::ControlLink;
use rackfs_proto::Refusal;
use rackfs_verbs::Region;
use serde::{Deserialize, Serialize};
use tracing::{error, info, warn};

use crate::membership::Membership;

/// What a snapshot carries: the namespace (encoded), the metadata area's live extents and the
/// answers kept per session.
#[derive(Serialize, Deserialize)]
struct Snapshot {
    namespace: Vec<u8>,
    extents: Vec<(u64, Vec<u8>)>,
    /// What the primary answered last per session, its own answers and those it took over
    /// with: a mount whose change was answered before the snapshot, and whose answer was lost,
    /// asks again as a retry, perhaps of a standby made from this one.
    answered: journal::Answered,
}

/// Primary: the snapshot of `m` a new standby starts from (the namespace and the bytes of its
/// metadata extents in `region`), encoded.
pub fn snapshot(m: &MetaService, region: &Region) -> Result<Vec<u8>, String> {
    let extents = m
        .namespace
        .meta_extents()
        .into_iter()
        .map(|(at, len)| {
            let mut b = vec![0; len as usize];
            region
                .read(at, &mut b)
                .expect("metadata extent in the region");
            (at, b)
        })
        .collect();
    let snapshot = Snapshot {
        namespace: postcard::to_allocvec(&m.namespace).map_err(|e| e.to_string())?,
        extents,
        answered: m.answered().clone(),
    };
    postcard::to_allocvec(&snapshot).map_err(|e| e.to_string())
}

/// A standby's copy of the primary's namespace, at journal entry `seq`, with the last answer
/// per session (a mount's retry after a take-over is answered from it).
pub struct Mirror {
    pub ns: Namespace,
    pub seq: u64,
    /// The primary it mirrors.
    pub primary: u32,
    pub answered: journal::Answered,
}

/// Both sides of the standby: on the primary, which node follows; on a data node, its mirror.
#[derive(Default)]
pub struct Standby {
    /// Primary: the data node whose mirror is in sync (named by the `standby` key), and the
    /// connection its journal goes over (its deadline is half a node lease: a standby that
    /// stalls the metadata service longer is dropped).
    follower: Mutex<Option<(u32, Arc<dyn ControlLink>)>>,
    /// Data node: the mirror, once a whole snapshot came in.
    mirror: Mutex<Option<Mirror>>,
    /// Data node: the snapshot pieces received so far, and the journal position they are of
    /// (pieces of another position start afresh: an earlier sync failed half-way).
    pieces: Mutex<(u64, Vec<u8>)>,
    /// Primary: when a standby last failed to sync, on the node's clock (retried after a
    /// pause).
    failed_at: Mutex<Option<Duration>>,
    /// Primary: extents a change released, freed once the standby has the change (see
    /// [`Standby::defer_free`]).
    deferred: Mutex<Vec<Free>>,
    /// Primary: changes made and not yet on the standby (see [`Standby::commit`]).
    outgoing: Mutex<Outgoing>,
    /// Signalled when a shipment ends.
    shipped: Bell,
    /// Primary: held from taking a shipment's entries until they are on the connection, so
    /// shipments go out in the order they took them (the standby refuses a gap).
    wire: Mutex<()>,
}

/// Shipments to the standby in flight at most: each is one round trip, and the standby
/// replays them one after another as they arrive.
const SHIPMENTS: usize = 8;

/// What one journal shipment carries ([`Standby::commit`]): the queueings after `from` up to
/// `upto`, and the wire until they are on the connection.
struct Shipment<'a> {
    entries: Vec<Entry>,
    frees: Vec<Free>,
    from: u64,
    upto: u64,
    /// A shipment before it was cut short: the standby goes first.
    broken: bool,
    wire: MutexGuard<'a, ()>,
}

/// The end of one shipment ([`Standby::commit`]), on every way out of it.
struct Shipped<'a> {
    standby: &'a Standby,
    upto: u64,
}

impl Drop for Shipped<'_> {
    fn drop(&mut self) {
        self.standby.shipped(self.upto);
    }
}

/// An extent to free on node `.0` at offset `.1` (with owner tag `.2`).
pub type Free = (u32, u64, Option<u64>);

/// Primary: journal entries queued under the metadata lock, in order, and the frees they hold
/// back; `queued` counts the queueings, `taken` those whose entries went into a shipment,
/// `acked` those whose entries the standby has (or that need it no more: no standby
/// follows). `acked <= taken <= queued`; shipments are acknowledged in the order they were
/// taken, but for one after a shipment cut short, which drops the standby first.
#[derive(Default)]
struct Outgoing {
    entries: Vec<Entry>,
    frees: Vec<Free>,
    queued: u64,
    taken: u64,
    acked: u64,
    /// Shipments taken and not yet ended.
    in_flight: usize,
    /// A shipment ended half-way (its caller panicked): its entries may never reach the
    /// standby, which must be dropped before anything more is acknowledged.
    broken: bool,
}

impl Standby {
    /// Whether this node holds a mirror (it may take over).
    pub fn has_mirror(&self) -> bool {
        self.mirror.lock().expect("mirror lock").is_some()
    }

    /// Primary: while a standby follows, an extent a change releases is freed only after the
    /// change reached the standby (`Node::with_meta`, [`Standby::commit`]): if the primary dies first, the standby's
    /// layout, which lacks the change, still finds the stripe whole. Returns whether it was
    /// held back.
    pub fn defer_free(&self, node: u32, offset: u64, tag: Option<u64>) -> bool {
        if self.follower().is_none() {
            return false;
        }
        self.deferred
            .lock()
            .expect("deferred lock")
            .push((node, offset, tag));
        true
    }

    /// The standby the primary keeps in sync, if any.
    pub fn follower(&self) -> Option<u32> {
        self.follower
            .lock()
            .expect("follower lock")
            .as_ref()
            .map(|f| f.0)
    }

    /// Primary: node `id` is in sync and follows over `conn` from now on.
    pub fn set_follower(&self, id: u32, conn: Arc<dyn ControlLink>) {
        *self.follower.lock().expect("follower lock") = Some((id, conn));
    }

    /// Primary: whether a standby failed to sync less than `retry` before `now`.
    pub fn failed_within(&self, retry: Duration, now: Duration) -> bool {
        matches!(*self.failed_at.lock().expect("failed lock"), Some(t) if now.saturating_sub(t) < retry)
    }

    /// Primary: a standby failed to sync at `now`.
    pub fn sync_failed(&self, now: Duration) {
        *self.failed_at.lock().expect("failed lock") = Some(now);
    }

    /// Primary, under the metadata lock: queues the journal entries `m` made and the frees
    /// they hold back, in the order the changes were made; returns the ticket to
    /// [`Standby::commit`] before answering.
    pub fn queue(&self, m: &mut MetaService) -> u64 {
        let entries = m.take_journal();
        let frees = std::mem::take(&mut *self.deferred.lock().expect("deferred lock"));
        let mut out = self.outgoing.lock().expect("outgoing lock");
        if !entries.is_empty() || !frees.is_empty() {
            out.entries.extend(entries);
            out.frees.extend(frees);
            out.queued += 1;
        }
        out.queued
    }

    /// Primary: whether every change queued so far has reached the standby (nothing in
    /// flight for a read to wait for). A hint: a change may be queued right after.
    pub fn all_shipped(&self) -> bool {
        let out = self.outgoing.lock().expect("outgoing lock");
        out.acked >= out.queued && out.in_flight == 0
    }

    /// Primary, outside the metadata lock: returns once the standby has every change queued
    /// up to `ticket` (or no standby follows any more), so that what a change's answer shows
    /// is in the mirror. Group commit: a caller whose change is not in a shipment yet ships
    /// everything queued so far in one journal RPC, and the others whose changes it took wait
    /// for it, so many changes share a round trip; up to `SHIPMENTS` (8) go at once, one after
    /// another on the connection, and each counts only once those before it did. A
    /// standby that does not take them is dropped (the `standby` key first, from `coord`,
    /// under the primary's `guard`: see `crate::term`), with `meta` locked, and the failure
    /// noted at `clock`'s now. Returns the extents the shipped changes released, to free now,
    /// or `None` if the standby did not take them and this primary no longer holds its term
    /// (deposed: a standby may serve a mirror without these changes, so nothing they released
    /// may be freed, and nothing more may be answered).
    pub fn commit(
        &self,
        ticket: u64,
        meta: &Mutex<MetaService>,
        members: &Membership,
        coord: &dyn Coordinator,
        clock: &dyn Clock,
        guard: impl FnOnce() -> Option<Guard>,
    ) -> Option<Vec<Free>> {
        let Some(Shipment {
            entries,
            frees,
            from,
            upto,
            broken,
            wire,
        }) = self.take_shipment(ticket)
        else {
            return Some(Vec::new());
        };
        // Whatever happens below (a panic included), the next caller may ship.
        let done = Shipped {
            standby: self,
            upto,
        };
        let mut sent = match (broken, self.follower()) {
            (true, Some(id)) => {
                drop(wire);
                Err((id, "a journal shipment was cut short".to_string()))
            }
            _ => self.ship(entries, members, wire),
        };
        // The standby took these entries only if it took those shipped before them.
        if !broken {
            let mut out = self.outgoing.lock().expect("outgoing lock");
            while out.acked < from && !out.broken {
                out = self.shipped.wait(out);
            }
            let cut_short_before = out.acked < from;
            drop(out);
            if let (true, Ok(()), Some(id)) = (cut_short_before, &sent, self.follower()) {
                sent = Err((
                    id,
                    "a journal shipment before this one was cut short".into(),
                ));
            }
        }
        let mut deposed = false;
        if let Err((id, why)) = sent {
            let mut m = meta.lock().expect("metadata lock");
            if self.follower() == Some(id) {
                deposed = self.drop_follower(&mut m, coord, guard(), id, &why, clock.now());
            }
        }
        drop(done);
        (!deposed).then_some(frees)
    }

    /// The shipment that carries `ticket`'s entries, taken here with everything queued
    /// meanwhile and holding the wire, if no shipment took them yet; `None` once the standby
    /// has them (a shipment that took them ended). Waits while [`SHIPMENTS`] are in flight.
    fn take_shipment(&self, ticket: u64) -> Option<Shipment<'_>> {
        let waits = |out: &Outgoing| {
            // Its entries taken by a shipment in flight (unless that one was cut short), or
            // no room for another.
            (out.taken >= ticket && !(out.broken && out.in_flight == 0))
                || out.in_flight >= SHIPMENTS
        };
        loop {
            let mut out = self.outgoing.lock().expect("outgoing lock");
            while out.acked < ticket && waits(&out) {
                out = self.shipped.wait(out);
            }
            if out.acked >= ticket {
                return None;
            }
            drop(out);
            // The wire before the queue (never the other way): shipments go out in the
            // order they took their entries, and queueing never waits for a send.
            // A shipment that panicked holding it is `broken`, which the next one handles.
            let wire = self.wire.lock().unwrap_or_else(PoisonError::into_inner);
            let mut out = self.outgoing.lock().expect("outgoing lock");
            if out.acked >= ticket || waits(&out) {
                continue;
            }
            let shipment = Shipment {
                entries: std::mem::take(&mut out.entries),
                frees: std::mem::take(&mut out.frees),
                from: out.taken,
                upto: out.queued,
                broken: std::mem::take(&mut out.broken),
                wire,
            };
            out.taken = out.queued;
            out.in_flight += 1;
            return Some(shipment);
        }
    }

    /// Marks the changes queued up to `upto` as shipped (or beyond a standby) and lets the next
    /// caller ship; after a panic, acknowledges nothing and has the next caller drop the
    /// standby first.
    fn shipped(&self, upto: u64) {
        let mut out = self.outgoing.lock().unwrap_or_else(|e| e.into_inner());
        if std::thread::panicking() {
            out.broken = true;
        } else {
            out.acked = out.acked.max(upto);
        }
        out.in_flight -= 1;
        self.shipped.notify_all();
    }

    /// Sends `entries` to the standby, if one follows, letting `wire` go once they are on the
    /// connection; the standby and why, if it did not take them.
    fn ship(
        &self,
        entries: Vec<Entry>,
        members: &Membership,
        wire: MutexGuard<'_, ()>,
    ) -> Result<(), (u32, String)> {
        if entries.is_empty() {
            return Ok(());
        }
        let Some((id, peer)) = self.follower.lock().expect("follower lock").clone() else {
            return Ok(());
        };
        if members.is_down(id) {
            return Err((id, "it is down".to_string()));
        }
        let bytes = postcard::to_allocvec(&entries).map_err(|e| (id, e.to_string()))?;
        let mut wire = Some(wire);
        let req = ControlRequest::Journal { entries: bytes };
        match peer.call_sent(&req, &mut || drop(wire.take())) {
            Ok(ControlResponse::Ok) => Ok(()),
            Ok(other) => Err((id, format!("unexpected answer {other:?}"))),
            Err(e) => Err((id, e.to_string())),
        }
    }

    /// Primary: declares a new epoch on the standby's journal connection (re-elected). A
    /// standby that does not take it is dropped as one that did not take the journal is
    /// (`standby` key first, journaling off, `meta` locked; synced again later), if it is still
    /// the one followed over that connection: left named while nothing ships to it, it could
    /// take over with a mirror missing every change made since, and the extents those changes
    /// released already freed. Then, unless a standby is followed, the key goes: it may still
    /// name one dropped while this node did not hold its term, also while the declaration was
    /// on its way (a shipment refused under the lapsed term, whose withdrawal of the key failed
    /// for it). The guard is this node's term when the metadata lock is held (`guard`).
    /// Returns false if this node turned out to be deposed.
    pub fn declare(
        &self,
        req: &ControlRequest,
        meta: &Mutex<MetaService>,
        coord: &dyn Coordinator,
        clock: &dyn Clock,
        guard: impl FnOnce() -> Option<Guard>,
    ) -> bool {
        let follower = self.follower.lock().expect("follower lock").clone();
        if let Some((id, peer)) = follower {
            if let Err(e) = peer.call(req) {
                let why = format!("it did not take this primary's new epoch: {e}");
                let mut m = meta.lock().expect("metadata lock");
                let same = matches!(&*self.follower.lock().expect("follower lock"), Some((_, p)) if Arc::ptr_eq(p, &peer));
                return !(same
                    && self.drop_follower(&mut m, coord, guard(), id, &why, clock.now()));
            }
        }
        let _m = meta.lock().expect("metadata lock");
        if self.follower().is_some() {
            return true;
        }
        let clear = Write::Delete {
            key: "standby".into(),
        };
        match crate::term::write_guarded(coord, guard().as_ref(), clear) {
            Err(CoordError::NotHeld { .. }) => false,
            Err(e) => {
                warn!(error = %e, "cannot clear the standby key of a standby no longer followed");
                true
            }
            Ok(()) => true,
        }
    }

    /// Primary: the standby fell out of sync at `now`; the `standby` key goes before anything
    /// else is answered.
    fn drop_follower(
        &self,
        m: &mut MetaService,
        coord: &dyn Coordinator,
        guard: Option<Guard>,
        id: u32,
        why: &str,
        now: Duration,
    ) -> bool {
        m.set_journaling(false);
        *self.failed_at.lock().expect("failed lock") = Some(now);
        let clear = Write::Delete {
            key: "standby".into(),
        };
        // The key goes before the follower: a shipment that finds no follower is answered
        // at once, so none may find it gone while the key still names the standby.
        let withdrawn = crate::term::write_guarded(coord, guard.as_ref(), clear);
        *self.follower.lock().expect("follower lock") = None;
        match withdrawn {
            Ok(()) => {
                warn!(standby = id, error = %why, "metadata standby dropped: the primary goes on alone until another is in sync");
                false
            }
            // Deposed: the standby key is the new primary's now, and this change is refused
            // (its lease lapsed, so it answers nothing).
            Err(CoordError::NotHeld { .. }) => {
                warn!(standby = id, error = %why, "the standby refused the journal and this primary no longer holds its term: it was deposed, and leaves the standby key alone");
                true
            }
            Err(e) => {
                error!(standby = id, error = %e, "cannot withdraw the standby's name from the coordinator: it could take over without the latest changes if this primary died now");
                false
            }
        }
    }

    /// Data node: one piece of a snapshot from the primary; the last one replaces the metadata
    /// area (`area` bytes at the start of `region`) and the mirror, unless the mirror held is
    /// of the same primary and further on: a snapshot the primary gave up on (its call timed
    /// out) can arrive after the one it sent next, and installing it would silently undo the
    /// changes between them, with nothing to reveal it until a later entry found the gap.
    pub fn take_piece(
        &self,
        region: &Region,
        area: u64,
        (primary, seq, last): (u32, u64, bool),
        piece: Vec<u8>,
    ) -> Result<(), Refusal> {
        let mut pieces = self.pieces.lock().expect("pieces lock");
        if pieces.0 != seq {
            *pieces = (seq, Vec::new());
        }
        pieces.1.extend_from_slice(&piece);
        if !last {
            return Ok(());
        }
        let bytes = std::mem::take(&mut pieces.1);
        let invalid = |what: &str, e: postcard::Error| {
            Refusal::new(ErrorCode::Invalid, format!("snapshot {what}: {e}"))
        };
        let snap: Snapshot = postcard::from_bytes(&bytes).map_err(|e| invalid("frame", e))?;
        let ns: Namespace =
            postcard::from_bytes(&snap.namespace).map_err(|e| invalid("namespace", e))?;
        if let Some((at, b)) = snap
            .extents
            .iter()
            .find(|(at, b)| at + b.len() as u64 > area)
        {
            return Err(Refusal::new(
                ErrorCode::OutOfMemory,
                format!(
                    "the primary's metadata extent at {at:#x} ({} bytes) lies beyond this node's metadata area of {area} bytes",
                    b.len()
                ),
            ));
        }
        // Checked and installed under the mirror's lock, which journal entries replay under.
        let mut mirror = self.mirror.lock().expect("mirror lock");
        if let Some(m) = mirror
            .as_ref()
            .filter(|m| m.primary == primary && m.seq > seq)
        {
            warn!(
                primary,
                seq,
                mirror = m.seq,
                "a snapshot older than this node's mirror of the same primary came late: ignored"
            );
            return Err(Refusal::new(
                ErrorCode::Invalid,
                format!(
                    "snapshot at journal entry {seq} is older than the mirror this node holds of \
                     primary {primary} (at entry {}): kept the newer",
                    m.seq
                ),
            ));
        }
        region
            .discard(0, area)
            .expect("metadata area inside the region");
        for (at, b) in &snap.extents {
            region.write(*at, b).expect("checked inside the area");
        }
        info!(
            primary,
            seq,
            files = snap.extents.len(),
            "mirroring the primary's namespace: this node is its metadata standby"
        );
        *mirror = Some(Mirror {
            ns,
            seq,
            primary,
            answered: snap.answered,
        });
        Ok(())
    }

    /// Data node: journal entries from the primary, replayed in order on the mirror (and its
    /// records in `region`). Any gap or divergence drops the mirror (the primary then drops
    /// this standby). Returns how many entries were replayed.
    pub fn take_journal(&self, region: &Region, bytes: &[u8]) -> Result<u64, Refusal> {
        let entries: Vec<Entry> = postcard::from_bytes(bytes)
            .map_err(|e| Refusal::new(ErrorCode::Invalid, format!("journal entries: {e}")))?;
        let mut guard = self.mirror.lock().expect("mirror lock");
        let Some(mirror) = guard.as_mut() else {
            return Err(Refusal::new(
                ErrorCode::Invalid,
                "this node has no mirror to apply journal entries to",
            ));
        };
        if let Some(e) = entries.iter().find(|e| e.primary != mirror.primary) {
            // An earlier primary's, late: refused, and this mirror kept.
            return Err(Refusal::new(
                ErrorCode::NotPrimary,
                format!(
                    "journal entry {} of node {}, but this node mirrors primary {}",
                    e.seq, e.primary, mirror.primary
                ),
            ));
        }
        let mut applied = 0;
        for e in entries {
            if e.seq <= mirror.seq {
                continue; // in the snapshot already (sent before it, on an earlier connection)
            }
            let result = if e.seq != mirror.seq + 1 {
                Err(format!(
                    "journal entry {} after {}: entries missing",
                    e.seq, mirror.seq
                ))
            } else {
                mirror.seq = e.seq;
                applied += 1;
                let step = e.step.clone();
                journal::replay(&mut mirror.ns, region, e)
                    .map(|out| mirror.answered.note(&step, &out))
            };
            if let Err(why) = result {
                *guard = None;
                error!(error = %why, "the mirror of the namespace diverged from the primary's: dropped");
                return Err(Refusal::new(ErrorCode::Internal, why));
            }
        }
        Ok(applied)
    }

    /// Data node taking over: the mirror, which it serves from now on.
    pub fn take_mirror(&self) -> Option<Mirror> {
        self.mirror.lock().expect("mirror lock").take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_meta::storage::MemStorage;
    use rackfs_proto::control::NodeAddr;
    use rackfs_proto::namespace::{MetaRequest, NewKind};
    use rackfs_proto::RpcError;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A standby that takes journal shipments as they arrive on its connection: it checks
    /// they come without a gap, lets the next go once it has the entries (as a socket would),
    /// and answers after a varying delay, so shipments overlap.
    #[derive(Default)]
    struct Follower {
        /// The last entry received, and the last one answered.
        received: Mutex<u64>,
        answered: AtomicU64,
        calls: AtomicU64,
        /// Shipments between arriving and being answered, now and at most.
        open: AtomicU64,
        most_open: AtomicU64,
    }

    impl ControlLink for Follower {
        fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
            self.call_sent(req, &mut || {})
        }
        fn call_sent(
            &self,
            req: &ControlRequest,
            sent: &mut dyn FnMut(),
        ) -> Result<ControlResponse, RpcError> {
            let ControlRequest::Journal { entries } = req else {
                panic!("not a journal shipment: {req:?}");
            };
            let entries: Vec<Entry> = postcard::from_bytes(entries).unwrap();
            let last = {
                let mut r = self.received.lock().unwrap();
                for e in &entries {
                    assert_eq!(e.seq, *r + 1, "entries in order, none missing");
                    *r = e.seq;
                }
                *r
            };
            let open = self.open.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_open.fetch_max(open, Ordering::SeqCst);
            sent();
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            // A varying delay (the node's code sleeps on no OS clock, tests included).
            for _ in 0..50 + (n * 7919) % 400 {
                std::thread::yield_now();
            }
            // The standby answers a connection's shipments in the order they came.
            while self.answered.load(Ordering::SeqCst) < last - entries.len() as u64 {
                std::thread::yield_now();
            }
            self.answered.store(last, Ordering::SeqCst);
            self.open.fetch_sub(1, Ordering::SeqCst);
            Ok(ControlResponse::Ok)
        }
        fn set_deadline(&self, _: Duration) {}
        fn peer(&self) -> &str {
            "follower"
        }
        fn node_id(&self) -> u32 {
            1
        }
        fn node_name(&self) -> &str {
            "mn1"
        }
    }

    /// A snapshot the primary gave up on that reaches the standby after the primary's next one
    /// is refused: the newer mirror, and the metadata area it wrote, stay.
    #[test]
    fn a_snapshot_carries_the_answers_kept_for_retries() {
        // Chaos on etcd: a rename in flight when the primary died was answered by it and
        // mirrored by its standby; that standby took over and made a third node its standby
        // by snapshot, then died before the mount's retry reached it. The third node, whose
        // snapshot carried no answers, made the rename again: ENOENT.
        let st = MemStorage::new(1, 16 << 20);
        let mut m = MetaService::new(Duration::from_secs(1), 1);
        let req = MetaRequest::Create {
            parent: 1,
            name: b"answered-before".to_vec(),
            kind: NewKind::Dir,
            perm: 0o755,
            uid: 0,
            gid: 0,
        };
        let answer = m.handle(7, req.clone(), &st);
        let seq = m.set_journaling(true);
        let snap = snapshot(&m, st.region(0)).unwrap();
        let standby = Standby::default();
        let region = Region::heap(16 << 20, 9, rackfs_verbs::Access::ALL);
        standby
            .take_piece(&region, 16 << 20, (0, seq, true), snap)
            .expect("the snapshot");
        let mut mirror = standby.take_mirror().expect("a mirror");
        assert_eq!(
            mirror.answered.take(7, &req),
            Some(answer),
            "the retry is answered as the change was"
        );
    }

    #[test]
    fn a_late_older_snapshot_leaves_the_newer_mirror() {
        let st = MemStorage::new(1, 16 << 20);
        let mut m = MetaService::new(Duration::from_secs(1), 1);
        let older_seq = m.set_journaling(true);
        let older = snapshot(&m, st.region(0)).unwrap();
        let req = MetaRequest::Create {
            parent: 1,
            name: b"made-between".to_vec(),
            kind: NewKind::Dir,
            perm: 0o755,
            uid: 0,
            gid: 0,
        };
        m.handle(1, req, &st);
        let newer_seq = m.journal_seq();
        assert!(newer_seq > older_seq);
        let newer = snapshot(&m, st.region(0)).unwrap();

        let standby = Standby::default();
        let region = Region::heap(16 << 20, 9, rackfs_verbs::Access::ALL);
        let area = 16 << 20;
        standby
            .take_piece(&region, area, (0, newer_seq, true), newer)
            .expect("the newer snapshot");
        let mut area_before = vec![0u8; 1 << 20];
        region.read(0, &mut area_before).unwrap();
        let refused = standby
            .take_piece(&region, area, (0, older_seq, true), older.clone())
            .expect_err("the older snapshot, late");
        assert!(
            refused.to_string().contains("older than the mirror"),
            "{refused}"
        );
        let mut area_after = vec![0u8; 1 << 20];
        region.read(0, &mut area_after).unwrap();
        assert!(area_before == area_after, "the metadata area is untouched");
        let mirror = standby.take_mirror().expect("a mirror");
        assert_eq!(mirror.seq, newer_seq);
        assert_eq!(
            mirror.ns.inodes(),
            m.namespace.inodes(),
            "the directory made between is kept"
        );
        assert!(mirror.ns.inodes() > 1);

        // Another primary's snapshot is not ordered against this one's: it replaces it.
        standby
            .take_piece(
                &region,
                area,
                (0, newer_seq, true),
                snapshot(&m, st.region(0)).unwrap(),
            )
            .unwrap();
        standby
            .take_piece(&region, area, (5, older_seq, true), older)
            .expect("a snapshot of another primary");
        assert_eq!(standby.take_mirror().unwrap().primary, 5);
    }

    /// Many changes committed at once: every one returns only once the standby answered its
    /// entries and all before them, several shipments overlap on the connection, and the
    /// entries arrive in order without a gap.
    #[test]
    fn overlapping_shipments_reach_the_standby_in_order_before_any_answer() {
        let st = MemStorage::new(1, 64 << 20);
        let mut m = MetaService::new(Duration::from_secs(1), 1);
        m.set_journaling(true);
        let meta = Mutex::new(m);
        let me = NodeAddr {
            node_id: 0,
            name: "mn0".into(),
            tcp: None,
            shm: None,
            capacity: 0,
            qos_area: 0,
            quarantine_ms: 0,
            domain: None,
        };
        let members = Membership::new(me, true);
        let coord = rackfs_coord::Local::new(Duration::from_secs(5));
        let clock = rackfs_clock::ManualClock::default();
        let standby = Standby::default();
        let follower = Arc::new(Follower::default());
        standby.set_follower(1, follower.clone());
        // More committing threads than shipments may be in flight: some always find the
        // shipments taken and queue, so a later shipment carries several changes. (With 8
        // threads for 8 shipments each change could get its own: 400 for 400 in a full-suite
        // run.)
        let threads = 2 * SHIPMENTS as u64;
        let changes = 400 / threads;
        std::thread::scope(|s| {
            for t in 0..threads {
                let (standby, meta, members, coord, clock, st, follower) =
                    (&standby, &meta, &members, &coord, &clock, &st, &follower);
                s.spawn(move || {
                    for i in 0..changes {
                        let (seq, ticket) = {
                            let mut m = meta.lock().unwrap();
                            let req = MetaRequest::Create {
                                parent: 1,
                                name: format!("f{t}-{i}").into_bytes(),
                                kind: NewKind::Dir,
                                perm: 0o755,
                                uid: 0,
                                gid: 0,
                            };
                            m.handle(1, req, st);
                            let seq = m.journal_seq();
                            (seq, standby.queue(&mut m))
                        };
                        let frees = standby.commit(ticket, meta, members, coord, clock, || None);
                        assert!(frees.is_some(), "the standby took every shipment");
                        assert!(
                            follower.answered.load(Ordering::SeqCst) >= seq,
                            "change {seq} answered before the standby had it"
                        );
                    }
                });
            }
        });
        assert_eq!(*follower.received.lock().unwrap(), threads * changes);
        assert_eq!(standby.follower(), Some(1), "never dropped");
        assert!(standby.all_shipped());
        assert!(
            follower.most_open.load(Ordering::SeqCst) > 1,
            "shipments overlapped"
        );
        let calls = follower.calls.load(Ordering::SeqCst);
        assert!(
            calls < threads * changes,
            "{calls} shipments for {} changes: group commit shares them",
            threads * changes
        );
    }

    /// A standby stopped: every call ends at its deadline.
    struct Stopped;

    impl ControlLink for Stopped {
        fn call(&self, _: &ControlRequest) -> Result<ControlResponse, RpcError> {
            Err(RpcError::Timeout {
                node: "mn1".into(),
                peer: "stopped".into(),
                after: Duration::from_secs(1),
            })
        }
        fn call_sent(
            &self,
            req: &ControlRequest,
            _: &mut dyn FnMut(),
        ) -> Result<ControlResponse, RpcError> {
            self.call(req)
        }
        fn set_deadline(&self, _: Duration) {}
        fn peer(&self) -> &str {
            "stopped"
        }
        fn node_id(&self) -> u32 {
            1
        }
        fn node_name(&self) -> &str {
            "mn1"
        }
    }

    /// A standby dropped while the re-elected primary declares its new epoch to it: a shipment
    /// refused under the lapsed term withdrew the standby but not its key (the term's lease was
    /// gone). The declaration then clears the key under the new term instead of leaving a
    /// standby named that nothing ships to.
    #[test]
    fn a_standby_dropped_under_the_old_term_during_the_declaration_is_unnamed() {
        /// Takes the declaration, while (as a refused shipment would) the standby is dropped
        /// under the old term.
        struct DroppedMeanwhile(Box<dyn Fn() + Send + Sync>);
        impl ControlLink for DroppedMeanwhile {
            fn call(&self, _: &ControlRequest) -> Result<ControlResponse, RpcError> {
                (self.0)();
                Ok(ControlResponse::Ok)
            }
            fn set_deadline(&self, _: Duration) {}
            fn peer(&self) -> &str {
                "standby"
            }
            fn node_id(&self) -> u32 {
                1
            }
            fn node_name(&self) -> &str {
                "mn1"
            }
        }
        let coord = Arc::new(rackfs_coord::Local::new(Duration::from_secs(5)));
        let (old_lease, _) = coord.grant(Duration::from_secs(5)).unwrap();
        coord.put("primary", b"0", Some(old_lease)).unwrap();
        coord.put("standby", b"1", None).unwrap();
        let old = Guard {
            key: "primary".into(),
            lease: old_lease,
        };
        // The old term lapsed and this node won the key again.
        coord.revoke(old_lease).unwrap();
        let (new_lease, _) = coord.grant(Duration::from_secs(5)).unwrap();
        coord.put("primary", b"0", Some(new_lease)).unwrap();
        let new = Guard {
            key: "primary".into(),
            lease: new_lease,
        };
        let mut m = MetaService::new(Duration::from_secs(1), 1);
        m.set_journaling(true);
        let meta = Arc::new(Mutex::new(m));
        let standby = Arc::new(Standby::default());
        let drop_old = {
            let (standby, meta, coord) = (standby.clone(), meta.clone(), coord.clone());
            move || {
                let mut m = meta.lock().unwrap();
                let deposed = standby.drop_follower(
                    &mut m,
                    &*coord,
                    Some(old.clone()),
                    1,
                    "refused",
                    Duration::ZERO,
                );
                assert!(deposed, "the old term's withdrawal of the key fails");
            }
        };
        standby.set_follower(1, Arc::new(DroppedMeanwhile(Box::new(drop_old))));
        let clock = rackfs_clock::ManualClock::default();
        let req = ControlRequest::Primary { node: 0, epoch: 7 };
        assert!(standby.declare(&req, &meta, &*coord, &clock, || Some(new)));
        assert_eq!(standby.follower(), None);
        assert_eq!(
            coord.get("standby").unwrap(),
            None,
            "no standby is named that nothing ships to"
        );
    }

    /// A re-elected primary whose standby does not take its new epoch drops it as it drops
    /// one that does not take the journal: the `standby` key goes (else the standby could
    /// take over later, its mirror missing what was answered meanwhile), journaling stops, and
    /// frees are no longer held back for it.
    #[test]
    fn a_standby_that_misses_the_new_epoch_is_dropped_and_unnamed() {
        let st = MemStorage::new(1, 64 << 20);
        let mut m = MetaService::new(Duration::from_secs(1), 1);
        m.set_journaling(true);
        let meta = Mutex::new(m);
        let coord = rackfs_coord::Local::new(Duration::from_secs(5));
        let (lease, _) = coord.grant(Duration::from_secs(5)).unwrap();
        coord.put("primary", b"0", Some(lease)).unwrap();
        coord.put("standby", b"1", None).unwrap();
        let term = Guard {
            key: "primary".into(),
            lease,
        };
        let clock = rackfs_clock::ManualClock::default();
        let standby = Standby::default();
        standby.set_follower(1, Arc::new(Stopped));
        let req = ControlRequest::Primary { node: 0, epoch: 7 };
        assert!(standby.declare(&req, &meta, &coord, &clock, || Some(term)));
        assert_eq!(standby.follower(), None);
        assert_eq!(
            coord.get("standby").unwrap(),
            None,
            "the standby is unnamed"
        );
        assert!(!standby.defer_free(2, 0, None), "frees wait for no standby");
        let mut m = meta.lock().unwrap();
        let req = MetaRequest::Create {
            parent: 1,
            name: b"after".to_vec(),
            kind: NewKind::Dir,
            perm: 0o755,
            uid: 0,
            gid: 0,
        };
        m.handle(1, req, &st);
        assert!(m.take_journal().is_empty(), "journaling stopped");
    }
}
