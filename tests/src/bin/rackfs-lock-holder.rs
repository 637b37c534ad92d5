//! A mount-like lock client for tests: joins the cluster as its own session, locks a range of
//! a file through the filesystem's lock code, prints `held`, holds it until its stdin closes
//! (or for at most 60 seconds), releases it and prints `released`. Killing it while it holds is
//! the point of most tests that use it.

use std::io::{Read, Write};
use std::time::Duration;

use rackfs_fs::cluster::Cluster;
use rackfs_fs::env::Env;
use rackfs_fs::lock::FileLocks;
use rackfs_fs::options::TransportChoice;
use rackfs_proto::control::ControlResponse;
use rackfs_proto::namespace::{MetaRequest, ROOT_INO};
use rackfs_verbs::Secret;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].clone())
            .unwrap_or_else(|| panic!("{flag} is required"))
    };
    let secret = Secret::from_file(get("--secret-file").as_ref()).expect("secret");
    let transport = match get("--transport").as_str() {
        "tcp" => TransportChoice::Tcp,
        _ => TransportChoice::Shm,
    };
    let (l, r) = get("--range")
        .split_once(':')
        .map(|(l, r)| {
            let r = if r == "inf" {
                u64::MAX
            } else {
                r.parse().expect("r")
            };
            (l.parse::<u64>().expect("l"), r)
        })
        .expect("--range L:R");
    let cl = Cluster::connect(
        Env::real(rackfs_verbs::poll::CONTROL_POLL),
        &[get("--cluster")],
        secret,
        transport,
        None,
        "lock-holder",
    )
    .expect("connect");
    let attr = match cl.primary().meta(MetaRequest::Lookup {
        parent: ROOT_INO,
        name: get("--file").into_bytes(),
    }) {
        Ok(ControlResponse::Attr(a)) => a,
        other => panic!("lookup: {other:?}"),
    };
    let layout = attr.layout.expect("a regular file");
    // One lock held until told: nothing to keep.
    let locks = FileLocks::new(attr.ino, layout.record, false);
    let held = locks.lock(&cl, l, r).expect("lock");
    println!("held");
    std::io::stdout().flush().expect("stdout");
    // Hold until stdin closes, at most 60 s.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        while matches!(std::io::stdin().read(&mut buf), Ok(n) if n > 0) {}
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(60));
    locks.unlock(&cl, held);
    println!("released");
}
