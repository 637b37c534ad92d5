//! A minimal verbs client for tests: connects, prints `ready`, then increments a counter until
//! killed (or for at most 60 seconds).

use std::io::Write;
use std::time::{Duration, Instant};

use rackfs_verbs::{RemoteAddr, Secret};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].clone())
    };
    let secret =
        Secret::from_file(get("--secret-file").expect("--secret-file").as_ref()).expect("secret");
    let qp = match (get("--shm"), get("--tcp")) {
        (Some(p), _) => rackfs_verbs::shm::connect(p.as_ref(), &secret, "verbs-client"),
        (_, Some(a)) => rackfs_verbs::tcp::connect(&a, &secret, "verbs-client"),
        _ => panic!("--shm PATH or --tcp ADDR"),
    }
    .expect("connect");
    let addr = RemoteAddr::new(qp.regions()[0].rkey, 0);
    qp.faa(addr, 1).expect("faa");
    println!("ready");
    std::io::stdout().flush().unwrap();
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        qp.faa(addr, 1).expect("faa");
    }
}
