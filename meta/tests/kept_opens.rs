//! Opens a mount keeps past its last close (`MetaRequest::Releases`' `kept`, `rackfs_fs::kept`):
//! the close settles and trims the file only when the kept open is its only one, the open is
//! counted on (the file outlives an unlink elsewhere), a kept open the session does not hold is
//! answered without attributes, and an unlink that gives the kept open back frees the file.

use std::time::Duration;

use rackfs_meta::{MemStorage, MetaService, Storage};
use rackfs_proto::namespace::{Attr, MetaRequest};
use rackfs_proto::{ControlResponse, ErrorCode};

const A: u64 = 7;
const B: u64 = 8;

fn service() -> (MetaService, MemStorage) {
    let st = MemStorage::new(1, 16 << 20);
    (MetaService::new(Duration::from_secs(2), st.wall_ns()), st)
}

/// Session `s` creates and opens `name` in the root, with stripe 0 placed for 4 KiB.
fn create(m: &mut MetaService, st: &MemStorage, s: u64, name: &str) -> u64 {
    let req = MetaRequest::CreateOpen {
        parent: 1,
        name: name.as_bytes().to_vec(),
        stripe_unit: 1 << 16,
        replicas: 1,
        perm: 0o644,
        uid: 0,
        gid: 0,
        reserve: 4096,
        lock_units: 0,
    };
    match m.handle(s, req, st) {
        ControlResponse::Created(c) => c.attr.ino,
        other => panic!("create {name}: {other:?}"),
    }
}

/// The attributes `Releases` answered for session `s`'s closes.
fn closes(m: &mut MetaService, st: &MemStorage, s: u64, inos: &[u64], kept: &[u64]) -> Vec<Attr> {
    let req = MetaRequest::Releases {
        inos: inos.to_vec(),
        kept: kept.to_vec(),
    };
    match m.handle(s, req, st) {
        ControlResponse::Released(a) => a,
        other => panic!("releases: {other:?}"),
    }
}

fn attr(m: &mut MetaService, st: &MemStorage, ino: u64) -> Result<Attr, ErrorCode> {
    match m.handle(A, MetaRequest::GetAttr { ino }, st) {
        ControlResponse::Attr(a) => Ok(a),
        ControlResponse::Error { code, .. } => Err(code),
        other => panic!("getattr: {other:?}"),
    }
}

fn unlink(m: &mut MetaService, st: &MemStorage, s: u64, name: &str, release: Option<u64>) {
    let req = MetaRequest::Unlink {
        parent: 1,
        name: name.as_bytes().to_vec(),
        release,
    };
    match m.handle(s, req, st) {
        ControlResponse::Attr(_) => {}
        other => panic!("unlink {name}: {other:?}"),
    }
}

#[test]
fn a_kept_close_trims_only_when_the_kept_open_is_the_files_only_one() {
    let (mut m, st) = service();
    // Alone: the close that keeps the open trims the empty file's stripe 0 away.
    let f = create(&mut m, &st, A, "f");
    assert!(attr(&mut m, &st, f).unwrap().allocated > 0);
    let answered = closes(&mut m, &st, A, &[], &[f]);
    assert_eq!(answered.len(), 1);
    assert_eq!(answered[0].allocated, 0, "trimmed: {:?}", answered[0]);
    // Another session has the file open: no trim at either's close while the kept open stays.
    let g = create(&mut m, &st, A, "g");
    assert!(matches!(
        m.handle(B, MetaRequest::Open { ino: g }, &st),
        ControlResponse::Attr(_)
    ));
    closes(&mut m, &st, A, &[], &[g]);
    assert!(attr(&mut m, &st, g).unwrap().allocated > 0, "B has it open");
    closes(&mut m, &st, B, &[g], &[]);
    assert!(
        attr(&mut m, &st, g).unwrap().allocated > 0,
        "A's kept open may be in use again: nothing trims under it"
    );
    // A gives it back: the last open goes, and the file is trimmed.
    closes(&mut m, &st, A, &[g], &[]);
    assert_eq!(attr(&mut m, &st, g).unwrap().allocated, 0);
}

#[test]
fn a_kept_open_holds_the_file_through_an_unlink_elsewhere_and_goes_with_its_own() {
    let (mut m, st) = service();
    let f = create(&mut m, &st, A, "f");
    closes(&mut m, &st, A, &[], &[f]);
    unlink(&mut m, &st, B, "f", None);
    assert_eq!(
        attr(&mut m, &st, f).unwrap().nlink,
        0,
        "kept open: still there"
    );
    closes(&mut m, &st, A, &[f], &[]);
    assert_eq!(attr(&mut m, &st, f), Err(ErrorCode::NotFound));
    // The keeping session's own unlink gives the open back with it.
    let g = create(&mut m, &st, A, "g");
    closes(&mut m, &st, A, &[], &[g]);
    unlink(&mut m, &st, A, "g", Some(g));
    assert_eq!(attr(&mut m, &st, g), Err(ErrorCode::NotFound));
}

#[test]
fn a_kept_close_of_a_file_the_session_does_not_hold_is_answered_without_attributes() {
    let (mut m, st) = service();
    let f = create(&mut m, &st, A, "f");
    assert!(closes(&mut m, &st, B, &[], &[f]).is_empty());
    // Its open, and the file, are untouched.
    assert_eq!(closes(&mut m, &st, A, &[], &[f]).len(), 1);
}
