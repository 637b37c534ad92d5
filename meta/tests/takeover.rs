//! A primary that took over from the standby's mirror answers a mount's retry of a change the
//! old primary made (its answer was lost with it) as the old one did, once, instead of
//! making it twice.

use std::time::Duration;

use rackfs_meta::journal::{self, Answered};
use rackfs_meta::{MemStorage, MetaService, Namespace, Storage};
use rackfs_proto::control::{ControlResponse, ErrorCode};
use rackfs_proto::namespace::{MetaRequest, NewKind, SetAttr, StripeExtent, ROOT_INO};
use rackfs_proto::record::TAG_SPACE;

fn create(name: &str) -> MetaRequest {
    MetaRequest::Create {
        parent: ROOT_INO,
        name: name.as_bytes().to_vec(),
        kind: NewKind::File {
            stripe_unit: 4096,
            replicas: 1,
        },
        perm: 0o644,
        uid: 0,
        gid: 0,
    }
}

fn retry(from: u64, req: MetaRequest) -> MetaRequest {
    MetaRequest::Retry {
        from,
        req: Box::new(req),
    }
}

/// Whether `r` is the refusal of a name that exists.
fn exists(r: &ControlResponse) -> bool {
    matches!(
        r,
        ControlResponse::Error {
            code: ErrorCode::Exists,
            ..
        }
    )
}

#[test]
fn a_retried_change_the_old_primary_made_is_answered_once_not_made_twice() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(1, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    old.set_journaling(true);
    // The standby: a snapshot of the empty namespace, then the journal.
    let mut ns = mirror_of(&old);
    let standby = MemStorage::new(1, 1 << 22);
    let mut answered = Answered::default();
    let (a, b) = (7, 8); // two mounts' sessions
    let made = old.handle(a, create("x"), &st);
    old.handle(b, create("y"), &st);
    old.handle(a, create("z"), &st); // a later change of the same session
    let ControlResponse::Attr(x) = &made else {
        panic!("{made:?}")
    };
    for e in old.take_journal() {
        let step = e.step.clone();
        let out = journal::replay(&mut ns, standby.local().1, e).unwrap();
        answered.note(&step, &out);
    }
    // The old primary dies; the standby takes over with what it replayed.
    let mut new = MetaService::over(ns, grace, 3);
    new.set_answered(answered);
    let c = 9; // mount a's new session
    assert_eq!(new.handle(c, retry(a, create("x")), &standby), made);
    // Answered once: the same retry again is a new change, and "x" exists.
    let again = new.handle(c, retry(a, create("x")), &standby);
    assert!(exists(&again), "{again:?}");
    // A retry of a change the old primary never made is made now.
    let w = new.handle(c, retry(a, create("w")), &standby);
    assert!(matches!(w, ControlResponse::Attr(_)), "{w:?}");
    // Another session's answers are not this one's.
    let y = new.handle(c, retry(a, create("y")), &standby);
    assert!(
        matches!(
            y,
            ControlResponse::Error {
                code: ErrorCode::Exists,
                ..
            }
        ),
        "{y:?}"
    );
    assert!(x.ino > 1);
}

/// A standby synced by snapshot copies each file record whole, its lock word too, which names
/// a tree in the old primary's region. The primary that takes over starts the lock trees
/// afresh: the word is cleared, so the next lock publishes a tree in its own region (found by
/// killing `rackfs up`'s primary twice: locks on such a file then failed for good).
#[test]
fn a_primary_that_took_over_publishes_fresh_lock_trees() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(1, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    let ControlResponse::Attr(f) = old.handle(7, create("f"), &st) else {
        panic!("create")
    };
    let tree = old.handle(
        7,
        MetaRequest::LockTree {
            ino: f.ino,
            old: 0,
            units: 64,
        },
        &st,
    );
    let ControlResponse::LockTree(word) = tree else {
        panic!("{tree:?}")
    };
    assert_ne!(word, 0);
    // The snapshot: the namespace, and the record's bytes at the same offset.
    let ns = mirror_of(&old);
    let standby = MemStorage::new(1, 1 << 22);
    let lock_word = ns.record(f.ino).unwrap() + rackfs_proto::record::REC_LOCKS;
    standby.local().1.store(lock_word, word).unwrap();
    let mut new = MetaService::over(ns, grace, 0);
    new.forget_old_lock_trees(&standby);
    assert_eq!(standby.local().1.load(lock_word).unwrap(), 0);
    let fresh = new.handle(
        9,
        MetaRequest::LockTree {
            ino: f.ino,
            old: 0,
            units: 64,
        },
        &standby,
    );
    let ControlResponse::LockTree(w) = fresh else {
        panic!("{fresh:?}")
    };
    assert_eq!(standby.local().1.load(lock_word).unwrap(), w);
    assert_ne!(w, 0);
}

/// A mount whose call timed out on a primary that is alive asks that same primary again, as a
/// retry: the change it made is answered again, not made twice (an unlink answered `ENOENT`
/// the second time, under `rackfs up`'s chaos on etcd).
#[test]
fn a_retried_change_on_the_same_primary_is_answered_once() {
    let st = MemStorage::new(1, 1 << 22);
    let mut p = MetaService::new(Duration::from_secs(2), st.wall_ns());
    let made = p.handle(7, create("x"), &st);
    assert!(matches!(made, ControlResponse::Attr(_)), "{made:?}");
    assert_eq!(p.handle(8, retry(7, create("x")), &st), made);
    let again = p.handle(8, retry(7, create("x")), &st);
    assert!(exists(&again), "{again:?}");
}

/// What a standby synced by snapshot holds of `m`'s namespace.
fn mirror_of(m: &MetaService) -> Namespace {
    postcard::from_bytes(&postcard::to_allocvec(&m.namespace).unwrap()).unwrap()
}

/// A two-replica file `name` whose first stripe holds `end` bytes, `bytes` written at its
/// start on every replica: its inode and the stripe's replicas.
fn written_stripe(
    p: &mut MetaService,
    st: &MemStorage,
    name: &str,
    end: u64,
    bytes: &[u8],
) -> (u64, Vec<StripeExtent>) {
    let ino = two_replica_file(p, st, name);
    let replicas = stripe0(p, st, ino, Some(end));
    for e in &replicas {
        st.region(e.node).write(e.offset, bytes).unwrap();
    }
    (ino, replicas)
}

/// A two-replica file with a 1 MiB stripe unit, made by session 7; its inode.
fn two_replica_file(p: &mut MetaService, st: &MemStorage, name: &str) -> u64 {
    let made = p.handle(
        7,
        MetaRequest::Create {
            parent: ROOT_INO,
            name: name.as_bytes().to_vec(),
            kind: NewKind::File {
                stripe_unit: 1 << 20,
                replicas: 2,
            },
            perm: 0o644,
            uid: 0,
            gid: 0,
        },
        st,
    );
    match made {
        ControlResponse::Attr(a) => a.ino,
        other => panic!("{other:?}"),
    }
}

fn stripe0(p: &mut MetaService, st: &MemStorage, ino: u64, end: Option<u64>) -> Vec<StripeExtent> {
    let req = match end {
        Some(end) => MetaRequest::AllocStripe {
            ino,
            stripe: 0,
            end,
        },
        None => MetaRequest::GetStripe { ino, stripe: 0 },
    };
    match p.handle(7, req, st) {
        ControlResponse::Stripe(s) => s,
        other => panic!("{other:?}"),
    }
}

/// Rolls the tables forward on each node that is up, as each follows the new primary:
/// (replicas relocated, dropped, old copies freed).
fn roll_forward(p: &mut MetaService, st: &MemStorage) -> (u64, u64, u64) {
    st.data_nodes().into_iter().fold((0, 0, 0), |(r, d, f), n| {
        let o = p.roll_forward(n, st);
        assert!(!o.unanswered);
        (r + o.relocated, d + o.dropped, f + o.freed)
    })
}

/// Whether each replica's node holds it under the tag the table lists (a mount's tag check
/// passes; otherwise every read of it fails with EIO).
fn held(st: &MemStorage, replicas: &[StripeExtent]) -> bool {
    replicas
        .iter()
        .all(|e| st.region(e.node).load(e.offset - TAG_SPACE).unwrap() == e.tag)
}

fn bytes_at(st: &MemStorage, e: &StripeExtent, at: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    st.region(e.node).read(e.offset + at, &mut b).unwrap();
    b
}

/// A two-replica file's first stripe, grown by the old primary (from 100 bytes, `first` at
/// its start, to 200,000) after its standby's mirror was taken.
struct Grown {
    mirror: Namespace,
    ino: u64,
    /// The stripe as the mirror lists it.
    small: Vec<StripeExtent>,
    /// The stripe as the old primary moved it.
    grown: Vec<StripeExtent>,
}

/// [`Grown`], with the nodes' frees held from the move on, as a primary holds them until its
/// standby has the change (the caller lets them go when the old primary dies).
fn grown_after_the_mirror(st: &MemStorage, grace: Duration) -> Grown {
    let mut old = MetaService::new(grace, st.wall_ns());
    let (ino, small) = written_stripe(&mut old, st, "grows", 100, b"first");
    let mirror = mirror_of(&old);
    st.hold_frees(true);
    let grown = stripe0(&mut old, st, ino, Some(200_000));
    assert!(grown.iter().all(|e| e.cap() >= 200_000), "{grown:?}");
    Grown {
        mirror,
        ino,
        small,
        grown,
    }
}

/// The old primary grew a file's first stripe (each replica moved to a larger extent, a
/// mount wrote to the new ones) and died before its standby had the change. The primary
/// that takes over lists the old, tombstoned extents: without following the nodes' history
/// every read of the stripe failed with EIO ("a file's first stripe that was being grown at
/// the instant of the kill"). Rolled forward, it lists the new extents, with every byte.
#[test]
fn a_stripe_moved_in_a_change_the_standby_lacks_is_followed_to_its_new_extents() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(3, 1 << 22);
    let g = grown_after_the_mirror(&st, grace);
    let (mirror, ino, small, grown) = (g.mirror, g.ino, g.small, g.grown);
    for e in &grown {
        st.region(e.node)
            .write(e.offset + 150_000, b"later")
            .unwrap();
    }
    let used = (0..3).map(|n| st.used(n)).sum::<u64>();
    // The old primary dies here, its frees unsent; its standby's records sit at the same
    // offsets.
    st.hold_frees(false);
    let mut new = MetaService::over(mirror, grace, 0);
    let listed = stripe0(&mut new, &st, ino, None);
    assert_eq!(listed, small);
    assert!(!held(&st, &listed), "the moved extents are tombstoned");
    let r = roll_forward(&mut new, &st);
    assert_eq!(r, (2, 0, 2));
    let now = stripe0(&mut new, &st, ino, None);
    assert_eq!(now, grown);
    assert!(held(&st, &now));
    for e in &now {
        assert_eq!(bytes_at(&st, e, 0, 5), b"first");
        assert_eq!(bytes_at(&st, e, 150_000, 5), b"later");
    }
    // The old copies went back to their nodes; nothing is left to roll forward.
    assert!((0..3).map(|n| st.used(n)).sum::<u64>() < used);
    assert_eq!(roll_forward(&mut new, &st), (0, 0, 0));
}

/// [`Grown`]'s file (its inode and its stripe as the mirror lists it) and the primary that
/// took over from the mirror, the old primary's frees let go, before any node followed it.
fn taken_over_after_growth(st: &MemStorage) -> (MetaService, u64, Vec<StripeExtent>) {
    let grace = Duration::from_secs(2);
    let g = grown_after_the_mirror(st, grace);
    st.hold_frees(false);
    let mut new = MetaService::over(g.mirror, grace, 0);
    new.take_over(st);
    (new, g.ino, g.small)
}

/// A mount's write growing file `ino`'s first stripe again, to 400,000 bytes.
fn grow_again(ino: u64) -> MetaRequest {
    MetaRequest::AllocStripe {
        ino,
        stripe: 0,
        end: 400_000,
    }
}

fn unavailable(r: &ControlResponse) -> bool {
    matches!(
        r,
        ControlResponse::Error {
            code: ErrorCode::Unavailable,
            ..
        }
    )
}

/// The old primary grew a stripe (its replicas moved, retagged) and died before its standby
/// had the change; a mount's write grows it again on the new primary before the replicas'
/// nodes followed it. The new primary must not touch the replicas its tables list there
/// (stale: the node refused the move as "not found", the write failed with ENOENT, and a
/// stripe with one replica followed dropped the other, good one): it answers Unavailable,
/// which the mount asks again, and grows the stripe once the nodes followed.
#[test]
fn a_stripe_grown_before_its_nodes_follow_the_new_primary_waits_for_them() {
    let st = MemStorage::new(3, 1 << 22);
    let (mut new, ino, _) = taken_over_after_growth(&st);
    let r = new.handle(9, grow_again(ino), &st);
    assert!(unavailable(&r), "grown before its nodes followed: {r:?}");
    roll_forward(&mut new, &st);
    let grown = stripe0(&mut new, &st, ino, Some(400_000));
    assert_eq!(grown.len(), 2, "both replicas kept: {grown:?}");
    assert!(grown.iter().all(|e| e.cap() >= 400_000), "{grown:?}");
    assert!(held(&st, &grown));
    for e in &grown {
        assert_eq!(bytes_at(&st, e, 0, 5), b"first");
    }
}

/// A node listed at the take-over that never follows the new primary (it died) blocks the
/// stripes it held only until it is dropped: then they grow on the replica that followed.
#[test]
fn a_node_dropped_before_it_followed_blocks_no_growth() {
    let st = MemStorage::new(3, 1 << 22);
    let (mut new, ino, small) = taken_over_after_growth(&st);
    let (followed, dead) = (small[0].node, small[1].node);
    assert!(!new.roll_forward(followed, &st).unanswered);
    assert!(unavailable(&new.handle(9, grow_again(ino), &st)));
    new.drop_node(dead, &st);
    let grown = stripe0(&mut new, &st, ino, Some(400_000));
    assert_eq!(grown.len(), 1, "{grown:?}");
    assert_eq!(grown[0].node, followed);
    assert!(grown[0].cap() >= 400_000 && held(&st, &grown));
    assert_eq!(bytes_at(&st, &grown[0], 0, 5), b"first");
}

/// The old primary moved one replica of a growing stripe but not the other (its node did not
/// answer) before it died: the new primary follows the moved one and drops the other, so a
/// stripe never lists replicas of two sizes (a write beyond the smaller found it too small
/// for ever, a read beyond it read zeros); the one left behind is freed.
#[test]
fn a_stripe_half_moved_when_the_primary_died_keeps_only_its_moved_replica() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(3, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    let (ino, small) = written_stripe(&mut old, &st, "half", 100, b"first");
    let mirror = mirror_of(&old);
    let behind = small[1];
    st.hold_frees(true);
    st.set_down(behind.node);
    let grown = stripe0(&mut old, &st, ino, Some(200_000));
    assert_eq!(grown.len(), 1, "{grown:?}");
    st.set_up(behind.node);
    st.hold_frees(false);
    let mut new = MetaService::over(mirror, grace, 0);
    let r = roll_forward(&mut new, &st);
    assert_eq!((r.0, r.1), (1, 1), "one followed, one left behind dropped");
    let now = stripe0(&mut new, &st, ino, None);
    assert_eq!(now, grown);
    assert!(held(&st, &now));
    assert_eq!(bytes_at(&st, &now[0], 0, 5), b"first");
    let left = st
        .region(behind.node)
        .load(behind.offset - TAG_SPACE)
        .unwrap();
    assert_ne!(left, behind.tag, "the replica left behind is freed");
}

/// The old primary started re-replicating a stripe (its survivor retagged, a copy made on
/// another node) and died before its standby had it: the survivor's new tag is followed, so
/// the stripe reads and is re-replicated again by the new primary.
#[test]
fn a_survivor_retagged_in_a_change_the_standby_lacks_is_followed_to_its_new_tag() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(3, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    let (ino, both) = written_stripe(&mut old, &st, "rebuilt", 4096, b"data");
    let gone = both[0].node;
    st.set_down(gone);
    old.drop_node(gone, &st);
    let mirror = mirror_of(&old);
    assert_eq!(old.rebuild(ino, 0, &st), Ok(4096));
    let mut new = MetaService::over(mirror, grace, 0);
    let listed = stripe0(&mut new, &st, ino, None);
    assert_eq!(listed.len(), 1);
    assert!(
        !held(&st, &listed),
        "the survivor carries the old primary's new tag"
    );
    let r = roll_forward(&mut new, &st);
    assert_eq!((r.0, r.1), (1, 0));
    let now = stripe0(&mut new, &st, ino, None);
    assert!(held(&st, &now));
    assert_eq!(bytes_at(&st, &now[0], 0, 4), b"data");
    assert_eq!(new.rebuild(ino, 0, &st), Ok(4096));
    let again = stripe0(&mut new, &st, ino, None);
    assert_eq!(again.len(), 2);
    assert!(held(&st, &again));
    assert!(again.iter().all(|e| bytes_at(&st, e, 0, 4) == b"data"));
}

/// A primary that took over answers each file's size as its mirror held it, whatever mounts
/// write or report since: a mount whose O_APPEND write was in flight at the old primary's
/// death learns from it whether that write landed as far as the filesystem knows.
#[test]
fn a_primary_that_took_over_tells_the_sizes_its_mirror_held() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(1, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    let ControlResponse::Attr(f) = old.handle(7, create("log"), &st) else {
        panic!("create")
    };
    let ns = mirror_of(&old);
    let size_word = ns.record(f.ino).unwrap() + rackfs_proto::record::REC_SIZE;
    // The mirror's record, as the old primary journaled it.
    let standby = MemStorage::new(1, 1 << 22);
    standby.local().1.store(size_word, 4096).unwrap();
    let mut new = MetaService::over(ns, grace, 0);
    let ask =
        |m: &mut MetaService| m.handle(9, MetaRequest::SizeAtTakeOver { ino: f.ino }, &standby);
    assert_eq!(
        ask(&mut new),
        ControlResponse::SizeAtTakeOver(None),
        "before it kept them"
    );
    new.take_over(&standby);
    // A mount appends one-sidedly, another reports what it wrote: the answer stays.
    standby.local().1.store(size_word, 5000).unwrap();
    let settle = MetaRequest::Settle {
        ino: f.ino,
        size: 9000,
        mtime: 1,
    };
    assert_eq!(new.handle(9, settle, &standby), ControlResponse::Ok);
    assert_eq!(ask(&mut new), ControlResponse::SizeAtTakeOver(Some(4096)));
    let other = MetaRequest::SizeAtTakeOver { ino: f.ino + 100 };
    assert_eq!(
        new.handle(9, other, &standby),
        ControlResponse::SizeAtTakeOver(None)
    );
    new.sizes_settled(&standby);
    assert_eq!(ask(&mut new), ControlResponse::SizeAtTakeOver(None));
}

/// A mount grew a file to 250,000 bytes under the old primary (the size one-sided in the old
/// primary's record) and closed it; the mirror's record holds the 70,000 of an earlier close.
/// A last close that reaches the primary that took over before that mount reports its size
/// trims nothing: trimmed to 70,000 bytes, the stripe read zeros past 70,016 once the report
/// came (blank bytes in files grown across a kill of the primary).
#[test]
fn a_last_close_before_the_mounts_report_their_sizes_trims_nothing() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(3, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    let (ino, grown) = written_stripe(&mut old, &st, "grown", 250_000, b"first");
    for e in &grown {
        st.region(e.node)
            .write(e.offset + 200_000, b"later")
            .unwrap();
    }
    let mirror = mirror_of(&old);
    let size_word = mirror.record(ino).unwrap() + rackfs_proto::record::REC_SIZE;
    st.local().1.store(size_word, 70_000).unwrap();
    let mut new = MetaService::over(mirror, grace, 0);
    new.take_over(&st);
    roll_forward(&mut new, &st);
    let close = |m: &mut MetaService| {
        let open = m.handle(9, MetaRequest::Open { ino }, &st);
        assert!(matches!(open, ControlResponse::Attr(_)), "{open:?}");
        let release = MetaRequest::Releases {
            inos: vec![ino],
            kept: vec![],
        };
        let released = m.handle(9, release, &st);
        assert!(
            matches!(released, ControlResponse::Released(_)),
            "{released:?}"
        );
        stripe0(m, &st, ino, None)
    };
    assert_eq!(close(&mut new), grown, "not trimmed to the mirror's size");
    let settle = MetaRequest::Settle {
        ino,
        size: 250_000,
        mtime: 1,
    };
    assert_eq!(new.handle(9, settle, &st), ControlResponse::Ok);
    assert!(grown
        .iter()
        .all(|e| bytes_at(&st, e, 200_000, 5) == b"later"));
    // Once the sizes settled, last closes trim again.
    new.sizes_settled(&st);
    st.local().1.store(size_word, 70_000).unwrap();
    let trimmed = close(&mut new);
    assert!(trimmed.iter().all(|e| e.cap() < 100_000), "{trimmed:?}");
}

/// A roll-forward is journaled like any change: a standby made before a data node followed
/// the primary that took over (it starts from a snapshot) lists the node's replicas where the
/// node holds them, not where the dead primary's mirror did, so a second take-over finds them.
#[test]
fn a_standby_replays_a_roll_forward_it_was_made_before() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(3, 1 << 22);
    let g = grown_after_the_mirror(&st, grace);
    let (mirror, ino, small, grown) = (g.mirror, g.ino, g.small, g.grown);
    st.hold_frees(false);
    let mut new = MetaService::over(mirror, grace, 0);
    new.take_over(&st);
    // Its standby, from a snapshot taken before any data node followed.
    new.set_journaling(true);
    let mut second = mirror_of(&new);
    assert_eq!(stripe0(&mut new, &st, ino, None), small);
    roll_forward(&mut new, &st);
    assert_eq!(stripe0(&mut new, &st, ino, None), grown);
    let standby = MemStorage::new(3, 1 << 22);
    for e in new.take_journal() {
        journal::replay(&mut second, standby.local().1, e).unwrap();
    }
    let mut third = MetaService::over(second, grace, 0);
    assert_eq!(stripe0(&mut third, &st, ino, None), grown);
    // Serials continue past the old primary's: the next allocation outnumbers the move.
    let serial = |e: &StripeExtent| rackfs_proto::record::tag_serial(e.tag);
    let next = stripe0(&mut third, &st, ino, Some(300_000));
    assert!(
        serial(&next[0]) > serial(&grown[0]) + 1000,
        "{next:?} {grown:?}"
    );
}

/// A mount opens the same file many times, so two of its opens are equal requests. One the
/// old primary never made, retried on the primary that took over, is made there, not answered
/// with an earlier open's answer: otherwise the file counted one open fewer than the mount
/// held, and an unlinked file went at the first of its last two closes.
#[test]
fn a_retried_open_is_matched_to_itself_not_to_an_earlier_equal_one() {
    let grace = Duration::from_secs(2);
    let st = MemStorage::new(1, 1 << 22);
    let mut old = MetaService::new(grace, st.wall_ns());
    old.set_journaling(true);
    let mut ns = mirror_of(&old);
    let mut answered = Answered::default();
    let a = 7;
    let numbered = |id, req| MetaRequest::Numbered {
        id,
        req: Box::new(req),
    };
    let ControlResponse::Attr(f) = old.handle(a, numbered(1, create("f")), &st) else {
        panic!("create")
    };
    let open = MetaRequest::Open { ino: f.ino };
    assert!(matches!(
        old.handle(a, numbered(2, open.clone()), &st),
        ControlResponse::Attr(_)
    ));
    for e in old.take_journal() {
        let step = e.step.clone();
        let out = journal::replay(&mut ns, st.local().1, e).unwrap();
        answered.note(&step, &out);
    }
    // Open number 3 was in flight when the old primary died, unmade.
    let mut new = MetaService::over(ns, grace, 2);
    new.set_answered(answered);
    let b = 9;
    let again = new.handle(b, retry(a, numbered(3, open)), &st);
    assert!(matches!(again, ControlResponse::Attr(_)), "{again:?}");
    new.adopt(a, b, &st);
    let unlink = MetaRequest::Unlink {
        parent: ROOT_INO,
        name: b"f".to_vec(),
        release: None,
    };
    assert!(!matches!(
        new.handle(b, unlink, &st),
        ControlResponse::Error { .. }
    ));
    let close = MetaRequest::Releases {
        inos: vec![f.ino],
        kept: vec![],
    };
    let getattr = MetaRequest::GetAttr { ino: f.ino };
    let released = new.handle(b, close.clone(), &st);
    assert!(
        matches!(released, ControlResponse::Released(_)),
        "{released:?}"
    );
    let held = new.handle(b, getattr.clone(), &st);
    assert!(
        matches!(held, ControlResponse::Attr(_)),
        "still open once: {held:?}"
    );
    assert_eq!(
        new.handle(b, close, &st),
        ControlResponse::Released(Vec::new()),
        "the file went with its last close"
    );
    let gone = new.handle(b, getattr, &st);
    assert!(
        matches!(
            gone,
            ControlResponse::Error {
                code: ErrorCode::NotFound,
                ..
            }
        ),
        "{gone:?}"
    );
}

/// A mount whose answer was lost asks again in a new session, and again in another if that
/// answer is lost too, each retry wrapping the one before. Found by the client core's
/// turnstile simulation (`fs/tests/turnstile_mounts.rs`): the second retry named only the
/// session of the first, whose answer the primary had not kept there, so an unlink made once
/// was answered ENOENT, a create EEXIST.
#[test]
fn a_retry_of_a_retry_finds_the_answer_in_any_session_the_change_went_through() {
    let st = MemStorage::new(1, 1 << 22);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    let numbered = |id, req| MetaRequest::Numbered {
        id,
        req: Box::new(req),
    };
    // Made in session 7; the answer is lost.
    let x = numbered(1, create("x"));
    let made = m.handle(7, x.clone(), &st);
    assert!(matches!(made, ControlResponse::Attr(_)), "{made:?}");
    // Retried in 8 (the answer lost again), then in 9 wrapping that retry.
    assert_eq!(m.handle(8, retry(7, x.clone()), &st), made);
    assert_eq!(m.handle(9, retry(8, retry(7, x.clone())), &st), made);
    // A change the first session never made is made by its first retry, and a retry of that
    // retry finds it in the session that made it.
    let y = numbered(2, create("y"));
    let first = m.handle(8, retry(7, y.clone()), &st);
    assert!(matches!(first, ControlResponse::Attr(_)), "{first:?}");
    assert_eq!(m.handle(9, retry(8, retry(7, y)), &st), first);
}

/// A session's connection may close (the mount gave up on it and dropped it, or the network
/// broke it) before the mount's retry arrives: its answers outlive its end.
#[test]
fn an_ended_sessions_answers_still_answer_its_retries() {
    let st = MemStorage::new(1, 1 << 22);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    let x = MetaRequest::Numbered {
        id: 1,
        req: Box::new(create("x")),
    };
    let made = m.handle(7, x.clone(), &st);
    m.end_session(7, &st);
    assert_eq!(m.handle(8, retry(7, x.clone()), &st), made);
    // Only the newest ended sessions are kept.
    for s in 100..100 + Answered::ENDED as u64 + 1 {
        m.handle(s, create(&format!("f{s}")), &st);
        m.end_session(s, &st);
    }
    assert!(
        exists(&m.handle(8, retry(7, x), &st)),
        "forgotten: made again"
    );
}

/// A truncate that cuts into a stripe whose replicas' nodes have not followed the new primary
/// waits for them as a growth does: zeroing or trimming the extents its tables list there
/// would meet extents moved since (refused, or a good replica dropped). Once they followed,
/// it cuts the stripe's real extents.
#[test]
fn a_truncate_before_the_nodes_follow_the_new_primary_waits_for_them() {
    let st = MemStorage::new(3, 1 << 22);
    let (mut new, ino, _) = taken_over_after_growth(&st);
    let truncate = |size| MetaRequest::SetAttr {
        ino,
        set: SetAttr {
            size: Some(size),
            ..SetAttr::default()
        },
    };
    // The size word lags behind the data after a take-over (mounts settle it): set it first.
    let r = new.handle(9, truncate(5), &st);
    assert!(
        matches!(r, ControlResponse::Attr(ref a) if a.size == 5),
        "{r:?}"
    );
    let r = new.handle(9, truncate(2), &st);
    assert!(unavailable(&r), "cut before its nodes followed: {r:?}");
    roll_forward(&mut new, &st);
    let r = new.handle(9, truncate(2), &st);
    assert!(
        matches!(r, ControlResponse::Attr(ref a) if a.size == 2),
        "{r:?}"
    );
    let kept = stripe0(&mut new, &st, ino, None);
    assert_eq!(kept.len(), 2, "both replicas kept: {kept:?}");
    assert!(held(&st, &kept));
    for e in &kept {
        assert_eq!(bytes_at(&st, e, 0, 5), b"fi\0\0\0");
    }
}

/// A truncate whose new last stripe cannot be zeroed on any replica (its nodes down) is
/// refused and changes nothing, so asking again once they are back zeroes the cut-off bytes.
/// (It left the size cut: the truncate asked again skipped the zeroing, and the bytes came
/// back when the file grew.)
#[test]
fn a_truncate_refused_for_down_nodes_changes_nothing_and_zeroes_when_asked_again() {
    let st = MemStorage::new(3, 1 << 22);
    let mut p = MetaService::new(Duration::from_secs(2), st.wall_ns());
    let (ino, replicas) = written_stripe(&mut p, &st, "cut", 100, b"abcdefghij");
    let truncate = |size| MetaRequest::SetAttr {
        ino,
        set: SetAttr {
            size: Some(size),
            ..SetAttr::default()
        },
    };
    let size_of = |r: ControlResponse| match r {
        ControlResponse::Attr(a) => a.size,
        other => panic!("{other:?}"),
    };
    assert_eq!(size_of(p.handle(9, truncate(10), &st)), 10);
    for e in &replicas {
        st.set_down(e.node);
    }
    let r = p.handle(9, truncate(3), &st);
    assert!(unavailable(&r), "{r:?}");
    assert_eq!(size_of(p.handle(9, MetaRequest::GetAttr { ino }, &st)), 10);
    for e in &replicas {
        st.set_up(e.node);
    }
    assert_eq!(size_of(p.handle(9, truncate(3), &st)), 3);
    assert_eq!(size_of(p.handle(9, truncate(10), &st)), 10);
    for e in &replicas {
        assert_eq!(bytes_at(&st, e, 0, 10), b"abc\0\0\0\0\0\0\0");
    }
}
