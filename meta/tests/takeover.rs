//! A primary that took over from the standby's mirror answers a mount's retry of a change the
//! old primary made (its answer was lost with it) as the old one did, once, instead of
//! making it twice.

use std::time::Duration;

use rackfs_meta::journal::{self, Answered};
use rackfs_meta::{MemStorage, MetaService, Namespace, Storage};
use rackfs_proto::control::{ControlResponse, ErrorCode};
use rackfs_proto::namespace::{MetaRequest, NewKind, ROOT_INO};

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
    let mut ns: Namespace =
        postcard::from_bytes(&postcard::to_allocvec(&old.namespace).unwrap()).unwrap();
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
    let ns: Namespace =
        postcard::from_bytes(&postcard::to_allocvec(&old.namespace).unwrap()).unwrap();
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
