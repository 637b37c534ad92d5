//! New files' first stripes placed from extents allocated ahead on the other nodes
//! (`rackfs_meta::pool`): every replica of a stripe still carries one tag, a standby following
//! the journal holds the same pool, nothing leaks beyond the pool, and a dead node's pooled
//! extents are forgotten.

use std::collections::BTreeSet;
use std::time::Duration;

use rackfs_meta::{MemStorage, MetaService, Namespace, Storage};
use rackfs_proto::namespace::{MetaRequest, StripeExtent};
use rackfs_proto::record::{tag_serial, TAG_SPACE};
use rackfs_proto::ControlResponse;

const SESSION: u64 = 7;

fn create(m: &mut MetaService, st: &MemStorage, name: &str) -> Vec<StripeExtent> {
    created(m, st, name).1
}

/// Creates `name` in the root: its inode and stripe 0's replicas.
fn created(m: &mut MetaService, st: &MemStorage, name: &str) -> (u64, Vec<StripeExtent>) {
    let req = MetaRequest::CreateOpen {
        parent: 1,
        name: name.as_bytes().to_vec(),
        stripe_unit: 1 << 16,
        replicas: 2,
        perm: 0o644,
        uid: 0,
        gid: 0,
        reserve: 4096,
        lock_units: 0,
    };
    match m.handle(SESSION, req, st) {
        ControlResponse::Created(c) => (c.attr.ino, c.stripe),
        other => panic!("create {name}: {other:?}"),
    }
}

fn unlink(m: &mut MetaService, st: &MemStorage, name: &str) {
    let ino = match m.handle(
        SESSION,
        MetaRequest::Lookup {
            parent: 1,
            name: name.as_bytes().to_vec(),
        },
        st,
    ) {
        ControlResponse::Attr(a) => a.ino,
        other => panic!("lookup {name}: {other:?}"),
    };
    m.handle(
        SESSION,
        MetaRequest::Releases {
            inos: vec![ino],
            kept: vec![],
        },
        st,
    );
    let req = MetaRequest::Unlink {
        parent: 1,
        name: name.as_bytes().to_vec(),
        release: None,
    };
    let answer = m.handle(SESSION, req, st);
    assert!(
        !matches!(answer, ControlResponse::Error { .. }),
        "unlink {name}: {answer:?}"
    );
}

/// Node memory a pooled or stripe extent of 4 KiB takes in [`MemStorage`].
const EXTENT: u64 = (4096 + TAG_SPACE).next_multiple_of(64);

#[test]
fn first_stripes_come_from_the_pool_with_one_tag_per_stripe_and_nothing_leaks() {
    let st = MemStorage::new(3, 1 << 24);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    let seq = m.set_journaling(true);
    let snapshot = postcard::to_allocvec(&m.namespace).unwrap();
    let mut serials = BTreeSet::new();
    for i in 0..70 {
        let stripe = create(&mut m, &st, &format!("f{i}"));
        assert_eq!(stripe.len(), 2, "file {i}: two replicas");
        assert_eq!(stripe[0].tag, stripe[1].tag, "file {i}: one tag per stripe");
        assert_ne!(stripe[0].node, stripe[1].node);
        assert!(
            serials.insert(tag_serial(stripe[0].tag)),
            "serials are unique"
        );
    }
    assert!(
        m.namespace.pooled_bytes() > 0,
        "70 files used three refills of 32 slots: some are left"
    );

    // A standby replaying the journal holds the same namespace, pool included.
    let mut standby: Namespace = postcard::from_bytes(&snapshot).unwrap();
    let region =
        rackfs_verbs::Region::create_memfd("standby", 1 << 24, 1, rackfs_verbs::Access::ALL)
            .unwrap();
    let mut at = seq;
    for e in m.take_journal() {
        assert_eq!(e.seq, at + 1);
        at = e.seq;
        let e = postcard::from_bytes(&postcard::to_allocvec(&e).unwrap()).unwrap();
        rackfs_meta::journal::replay(&mut standby, &region, e).unwrap();
    }
    assert_eq!(
        postcard::to_allocvec(&standby).unwrap(),
        postcard::to_allocvec(&m.namespace).unwrap(),
        "the standby's namespace (and pool) differs from the primary's"
    );

    // Every file gone, only the pool holds memory: extents of slots the placement left over
    // were freed, none was lost.
    for i in 0..70 {
        unlink(&mut m, &st, &format!("f{i}"));
    }
    let used: u64 = (0..3).map(|n| st.used(n)).sum();
    let pooled = m.namespace.pooled_bytes() / 4096;
    assert_eq!(
        used,
        pooled * EXTENT,
        "{pooled} pooled extents, {used} bytes held"
    );
}

#[test]
fn a_dead_nodes_pooled_extents_are_forgotten() {
    let st = MemStorage::new(3, 1 << 24);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    create(&mut m, &st, "first");
    let before = m.namespace.pooled_bytes();
    assert!(before > 0);
    st.set_down(2);
    m.drop_node(2, &st);
    let after = m.namespace.pooled_bytes();
    assert!(
        after < before,
        "node 2's pooled extents dropped: {before} -> {after}"
    );
    for i in 0..40 {
        let stripe = create(&mut m, &st, &format!("f{i}"));
        assert!(
            stripe.iter().all(|e| e.node != 2),
            "file {i} placed on the dead node: {stripe:?}"
        );
        assert_eq!(
            stripe.len(),
            2,
            "file {i}: nodes 0 and 1 take its two replicas"
        );
    }
}

#[test]
fn a_lone_node_places_without_a_pool() {
    let st = MemStorage::new(1, 1 << 24);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    for i in 0..5 {
        assert_eq!(create(&mut m, &st, &format!("f{i}")).len(), 1);
    }
    assert_eq!(m.namespace.pooled_bytes(), 0);
}

#[test]
fn memory_running_short_takes_the_pooled_extents_back() {
    // Room for about 60 extents of 4 KiB on each node.
    let st = MemStorage::new(2, 256 << 10);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    create(&mut m, &st, "first");
    assert!(m.namespace.pooled_bytes() > 0);
    let stripe_of = |m: &mut MetaService, st: &MemStorage, name: &str| create(m, st, name).len();
    let used = |st: &MemStorage| (0..2).map(|n| st.used(n)).sum::<u64>();
    let mut short_at = None;
    let mut pooled_before = 0;
    for i in 0..200 {
        pooled_before = m.namespace.pooled_bytes() / 4096;
        let before = used(&st);
        if stripe_of(&mut m, &st, &format!("f{i}")) < 2 {
            short_at = Some((i, before));
            break;
        }
    }
    let (i, before) = short_at.expect("the nodes fill up within 200 files");
    assert_eq!(
        m.namespace.pooled_bytes(),
        0,
        "file {i} got fewer replicas: the pool gave its extents back"
    );
    assert!(
        pooled_before > 0,
        "the pool held extents when memory ran short"
    );
    assert!(
        used(&st) < before,
        "the {pooled_before} pooled extents' memory came back: {before} -> {}",
        used(&st)
    );
    // The pool is not filled again while memory is short.
    for k in 0..5 {
        stripe_of(&mut m, &st, &format!("after{k}"));
        assert_eq!(m.namespace.pooled_bytes(), 0, "no refill after giving back");
    }
}

#[test]
fn a_degraded_stripe_with_nowhere_to_go_takes_the_pooled_extents_back() {
    let st = MemStorage::new(3, 1 << 20);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    let (ino, stripe) = created(&mut m, &st, "first");
    let holders: Vec<u32> = stripe.iter().map(|e| e.node).collect();
    let spare = (0..3).find(|n| !holders.contains(n)).unwrap();
    assert_ne!(
        spare, 0,
        "the primary's own node takes a replica of a new file"
    );
    assert!(m.namespace.pooled_bytes() > 0);
    // Every node full; then the node of a replica other than `spare`'s dies.
    for n in 0..3 {
        while st.alloc(n, 4096, None).is_ok() {}
    }
    let dead = *holders.iter().find(|&&n| n != 0).unwrap_or(&0);
    st.set_down(dead);
    m.drop_node(dead, &st);
    assert!(
        m.namespace.pooled_bytes() > 0,
        "the spare node's pooled extents stay"
    );
    let before = st.used(spare);
    assert_eq!(
        m.rebuild(ino, 0, &st),
        Ok(0),
        "node {spare} is full: nothing is copied"
    );
    assert_eq!(
        m.namespace.pooled_bytes(),
        0,
        "the pool gave its extents back for the stripe"
    );
    // (`MemStorage` never reuses freed memory; a data node's store gives it to the next
    // round's copy.)
    assert!(
        st.used(spare) < before,
        "node {spare}'s pooled memory came back: {before} -> {}",
        st.used(spare)
    );
}
