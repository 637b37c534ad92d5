//! The primary looks for degraded stripes a bounded number of inodes at a time (it holds the
//! metadata lock meanwhile): going round in budgets finds exactly what one whole look finds.

use std::collections::BTreeSet;
use std::time::Duration;

use rackfs_meta::{MemStorage, MetaService, Storage};
use rackfs_proto::namespace::MetaRequest;
use rackfs_proto::ControlResponse;

#[test]
fn a_scan_in_budgets_finds_every_degraded_stripe() {
    let st = MemStorage::new(3, 1 << 24);
    let mut m = MetaService::new(Duration::from_secs(2), st.wall_ns());
    for i in 0..40 {
        let req = MetaRequest::CreateOpen {
            parent: 1,
            name: format!("f{i}").into_bytes(),
            stripe_unit: 1 << 16,
            replicas: 2,
            perm: 0o644,
            uid: 0,
            gid: 0,
            reserve: 4096,
            lock_units: 0,
        };
        let made = m.handle(7, req, &st);
        assert!(matches!(made, ControlResponse::Created(_)), "{made:?}");
    }
    let (none, end) = m.namespace.degraded_stripes(0, usize::MAX, usize::MAX);
    assert_eq!((none.len(), end), (0, 0), "nothing is degraded yet");
    st.set_down(2);
    m.drop_node(2, &st);
    let (whole, end) = m.namespace.degraded_stripes(0, usize::MAX, usize::MAX);
    assert_eq!(end, 0);
    assert!(
        whole.len() >= 10,
        "node 2 held a replica of {} of 40 stripes",
        whole.len()
    );
    let mut found = BTreeSet::new();
    let (mut from, mut rounds) = (0, 0);
    loop {
        let (v, next) = m.namespace.degraded_stripes(from, 7, usize::MAX);
        found.extend(v);
        rounds += 1;
        if next == 0 {
            break;
        }
        assert!(next > from, "the scan moves on");
        from = next;
    }
    assert_eq!(found, whole.into_iter().collect::<BTreeSet<_>>());
    assert!(
        rounds >= 6,
        "41 inodes in budgets of 7 take 6 rounds, not {rounds}"
    );
}
