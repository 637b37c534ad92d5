//! The memory-node daemon as clients and operators meet it: authentication, allocation,
//! statistics, malformed input, and clients that die.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use rackfs_proto::control::{ErrorCode, RPC_KINDS};
use rackfs_proto::RpcError;
use rackfs_tests::{bin_path, wait_for, MemNodeProcess};
use rackfs_verbs::auth::client_handshake;
use rackfs_verbs::wire::{self, ConnKind, FrameKind};
use rackfs_verbs::{Batch, RemoteAddr, Secret, VerbsError};

#[test]
fn wrong_secret_is_refused_clearly_on_both_sides() {
    let node = MemNodeProcess::start("8M");
    let wrong = Secret::generate();
    let err = rackfs_verbs::tcp::connect(&node.tcp, &wrong, "intruder").unwrap_err();
    assert!(matches!(err, VerbsError::Auth { .. }), "{err:?}");
    assert!(err.to_string().contains("wrong cluster secret"), "{err}");
    let err = rackfs_verbs::shm::connect(&node.shm, &wrong, "intruder").unwrap_err();
    assert!(err.to_string().contains("wrong cluster secret"), "{err}");
    // The node counts a refusal right after sending it.
    assert!(wait_for(Duration::from_secs(5), || node
        .control()
        .stats()
        .unwrap()
        .auth_failures
        == 2));
    assert!(wait_for(Duration::from_secs(5), || node
        .stderr()
        .contains("wrong cluster secret")));
    // The right secret still works.
    node.tcp_qp()
        .faa(RemoteAddr::new(node.tcp_qp().regions()[0].rkey, 0), 1)
        .unwrap();
}

#[test]
fn a_node_with_another_secret_is_not_trusted_by_the_client() {
    // The client checks the node's proof too: a fake node that admits anyone, without knowing
    // the secret, is detected before the connection is used.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut body = Vec::new();
        wire::read_frame(&mut s, &mut body).unwrap(); // hello
        let challenge = wire::Challenge { nonce: [7; 32] };
        wire::write_frame(&mut s, FrameKind::Challenge, &challenge.encode()).unwrap();
        wire::read_frame(&mut s, &mut body).unwrap(); // the client's proof
        let welcome = wire::Welcome {
            proof: [0; 32],
            node_name: "impostor".into(),
            node_id: 0,
            regions: Vec::new(),
        };
        wire::write_frame(&mut s, FrameKind::Welcome, &welcome.encode()).unwrap();
    });
    let mut s = TcpStream::connect(&addr).unwrap();
    let err =
        client_handshake(&mut s, ConnKind::Verbs, &Secret::generate(), "c", 0, &addr).unwrap_err();
    assert!(err.to_string().contains("proof does not match"), "{err}");
    fake.join().unwrap();
}

#[test]
fn an_unauthenticated_peer_learns_nothing_and_a_replay_is_named() {
    let node = MemNodeProcess::start("8M");
    let hello = wire::Hello {
        kind: ConnKind::Verbs,
        nonce: [42; 32],
        client_name: "guesser".into(),
        fence: 0,
        sent_ns: 0,
    };
    let mut s = TcpStream::connect(&node.tcp).unwrap();
    wire::write_frame(&mut s, FrameKind::Hello, &hello.encode()).unwrap();
    let mut body = Vec::new();
    assert_eq!(
        wire::read_frame(&mut s, &mut body).unwrap(),
        FrameKind::Challenge
    );
    // The challenge is the node's nonce and nothing more: no proof to test guesses against.
    assert_eq!(body.len(), 32, "challenge body: {body:?}");
    wire::write_frame(&mut s, FrameKind::Proof, &[0u8; 32]).unwrap();
    assert_eq!(
        wire::read_frame(&mut s, &mut body).unwrap(),
        FrameKind::Refused
    );
    assert!(String::from_utf8_lossy(&body).contains("wrong cluster secret"));
    // The same hello again is a replay, refused as such before any challenge.
    let mut s = TcpStream::connect(&node.tcp).unwrap();
    wire::write_frame(&mut s, FrameKind::Hello, &hello.encode()).unwrap();
    assert_eq!(
        wire::read_frame(&mut s, &mut body).unwrap(),
        FrameKind::Refused
    );
    assert!(String::from_utf8_lossy(&body).contains("replayed"));
    assert!(wait_for(Duration::from_secs(5), || node
        .stderr()
        .contains("replayed handshake")));
}

#[test]
fn weak_secret_files_are_refused_with_how_to_make_one() {
    let dir = rackfs_tests::TempDir::new("weak");
    for (text, why) in [
        ("password", "8 characters"),
        ("aaaaaaaaaaaaaaaaaaaa", "distinct"),
    ] {
        let f = dir.path().join("secret");
        std::fs::write(&f, text).unwrap();
        let out = std::process::Command::new(bin_path("rackfs-memnode"))
            .args(["--region", "8M", "--listen", "127.0.0.1:0", "--secret-file"])
            .arg(&f)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a node started with {text:?}");
        assert!(
            err.contains("too weak") && err.contains(why) && err.contains("/dev/urandom"),
            "{err}"
        );
    }
}

#[test]
fn shm_over_tcp_is_refused_with_a_reason() {
    let node = MemNodeProcess::start("8M");
    let mut s = TcpStream::connect(&node.tcp).unwrap();
    let err = client_handshake(&mut s, ConnKind::Shm, &node.secret, "c", 0, &node.tcp).unwrap_err();
    assert!(err.to_string().contains("Unix socket"), "{err}");
}

#[test]
fn allocation_reuses_space_and_reports_full_nodes() {
    let node = MemNodeProcess::start("4M");
    let ctl = node.control();
    let before = ctl.stats().unwrap();
    assert_eq!(before.capacity, 4 << 20);
    let (region, a) = ctl.alloc(1 << 20, 4096).unwrap();
    assert_eq!(a % 4096, 0);
    let (_, b) = ctl.alloc(1 << 20, 4096).unwrap();
    assert_ne!(a, b);
    let s = ctl.stats().unwrap();
    assert_eq!((s.used, s.extents), (2 << 20, 2));
    // The extent is real memory: write it with verbs and read it back.
    let qp = node.tcp_qp();
    qp.write(RemoteAddr::new(region.rkey, a + 100), b"hello")
        .unwrap();
    assert_eq!(
        node.shm_qp()
            .read(RemoteAddr::new(region.rkey, a + 100), 5)
            .unwrap(),
        b"hello"
    );

    let err = ctl.alloc(3 << 20, 4096).unwrap_err();
    match &err {
        RpcError::Refused {
            code: ErrorCode::OutOfMemory,
            message,
        } => {
            assert!(
                message.starts_with(
                    "out of memory on node mn0: requested 3.00 MiB, largest free extent 2.00 MiB"
                ),
                "{message}"
            );
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(ctl.free(a, None).unwrap(), 1 << 20);
    assert!(
        matches!(
            ctl.free(a, None),
            Err(RpcError::Refused {
                code: ErrorCode::NotFound,
                ..
            })
        ),
        "double free is refused"
    );
    assert_eq!(
        ctl.alloc(1 << 20, 4096).unwrap().1,
        a,
        "freed space is reused"
    );
    assert!(matches!(
        ctl.alloc(0, 64),
        Err(RpcError::Refused {
            code: ErrorCode::Invalid,
            ..
        })
    ));
    assert!(matches!(
        ctl.alloc(64, 3),
        Err(RpcError::Refused {
            code: ErrorCode::Invalid,
            ..
        })
    ));
    let s = ctl.stats().unwrap();
    let alloc = RPC_KINDS.iter().position(|k| *k == "alloc").unwrap();
    assert_eq!(s.rpcs[alloc], 6, "alloc RPCs counted: {:?}", s.rpcs);
}

#[test]
fn data_path_costs_no_control_rpc() {
    let node = MemNodeProcess::start("8M");
    let ctl = node.control();
    let rpcs_before: u64 = ctl.stats().unwrap().rpcs.iter().sum();
    for qp in [node.tcp_qp(), node.shm_qp()] {
        let rkey = qp.regions()[0].rkey;
        for i in 0..100u64 {
            let mut b = Batch::new();
            b.write_u64(RemoteAddr::new(rkey, i * 8), i);
            b.read(RemoteAddr::new(rkey, i * 8), 8);
            b.faa(RemoteAddr::new(rkey, 4096), 1);
            qp.execute(b).unwrap().check().unwrap();
        }
    }
    let s = ctl.stats().unwrap();
    // Only the one stats call in between.
    assert_eq!(s.rpcs.iter().sum::<u64>(), rpcs_before + 1);
    assert!(s.verbs.total_ops() >= 600, "{:?}", s.verbs);
    assert!(s.verbs.batches >= 200);
}

/// Sends `bytes` after an optional handshake and checks the node closes that connection and
/// keeps serving everyone else.
fn send_garbage(node: &MemNodeProcess, authenticate: bool, bytes: &[u8]) {
    let mut s = TcpStream::connect(&node.tcp).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    if authenticate {
        client_handshake(&mut s, ConnKind::Verbs, &node.secret, "fuzz", 0, &node.tcp).unwrap();
    }
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink); // the node answers what it can, then closes
}

#[test]
fn malformed_frames_close_only_their_connection() {
    let node = MemNodeProcess::start("8M");
    let good = node.tcp_qp();
    let rkey = good.regions()[0].rkey;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let valid = {
        let mut b = wire::encode_header(FrameKind::VerbsRequest, 0).to_vec();
        let mut body = Vec::new();
        let mut batch = Batch::new();
        batch.faa(RemoteAddr::new(rkey, 0), 1);
        batch.write(RemoteAddr::new(rkey, 8), b"abcdefgh");
        wire::encode_verbs_request(&mut body, &wire::BatchHead::default(), batch.requests());
        b[4..8].copy_from_slice(&(body.len() as u32).to_le_bytes());
        b.extend_from_slice(&body);
        b
    };
    for round in 0..60 {
        let mut bytes = match round % 4 {
            0 => (0..rnd() % 200).map(|_| rnd() as u8).collect::<Vec<u8>>(),
            1 => valid.clone(),
            _ => valid.clone(),
        };
        if round % 4 >= 1 {
            // Mutate a valid frame: flip bytes, truncate, or extend.
            for _ in 0..1 + rnd() % 4 {
                let i = (rnd() as usize) % bytes.len();
                bytes[i] = rnd() as u8;
            }
            if round % 4 == 3 {
                bytes.truncate((rnd() as usize) % bytes.len());
            }
        }
        send_garbage(&node, round % 2 == 1 || round % 4 >= 2, &bytes);
        // The node is alive and correct for a well-behaved client after every bad one.
        good.faa(RemoteAddr::new(rkey, 4096), 1).unwrap();
    }
    assert_eq!(
        u64::from_le_bytes(
            good.read(RemoteAddr::new(rkey, 4096), 8)
                .unwrap()
                .try_into()
                .unwrap()
        ),
        60
    );
    let s = node.control().stats().unwrap();
    assert!(s.protocol_errors > 0, "malformed input is counted: {s:?}");
    // An oversized length prefix is refused without allocating it.
    let mut huge = wire::encode_header(FrameKind::VerbsRequest, 0).to_vec();
    huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    send_garbage(&node, true, &huge);
    good.faa(RemoteAddr::new(rkey, 4096), 1).unwrap();
    assert!(wait_for(Duration::from_secs(5), || node
        .stderr()
        .contains("exceeds the limit")));
}

#[test]
fn a_client_that_dies_mid_batch_leaks_nothing() {
    let node = MemNodeProcess::start("8M");
    let ctl = node.control();
    let baseline = ctl.stats().unwrap().open;
    // A half-sent batch, then the client vanishes.
    {
        let mut s = TcpStream::connect(&node.tcp).unwrap();
        client_handshake(&mut s, ConnKind::Verbs, &node.secret, "dying", 0, &node.tcp).unwrap();
        let mut frame = wire::encode_header(FrameKind::VerbsRequest, 1000).to_vec();
        frame.extend_from_slice(&[0u8; 100]);
        s.write_all(&frame).unwrap();
    }
    // A separate process mapping the region over shm and hammering it, killed with SIGKILL.
    let mut child = std::process::Command::new(bin_path("rackfs-verbs-client"))
        .args([
            "--shm",
            node.shm.to_str().unwrap(),
            "--secret-file",
            node.secret_file.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = [0u8; 6];
    child.stdout.take().unwrap().read_exact(&mut line).unwrap(); // "ready\n"
    assert!(wait_for(Duration::from_secs(5), || ctl
        .stats()
        .unwrap()
        .open[2]
        == baseline[2] + 1));
    child.kill().unwrap();
    child.wait().unwrap();
    assert_open_back_to(&ctl, &baseline, Duration::from_secs(5), "dead clients'");
    // The dead client's verbs are still accounted for, and the node serves others.
    assert!(ctl.stats().unwrap().verbs.ops[3] > 0);
    let qp = node.tcp_qp();
    qp.faa(RemoteAddr::new(qp.regions()[0].rkey, 0), 1).unwrap();
}

/// Waits up to `within` for the node's open connections to be `baseline` again: `whose`
/// connections were closed.
fn assert_open_back_to(
    ctl: &rackfs_proto::ControlClient,
    baseline: &[u64],
    within: Duration,
    whose: &str,
) {
    assert!(
        wait_for(within, || ctl.stats().unwrap().open == baseline),
        "{whose} connections are closed: {:?} vs {baseline:?}",
        ctl.stats().unwrap().open,
    );
}

/// A client gone before the node answers its large READs (which the node sends straight from
/// its region) ends only its own connection: the node lives on and serves others.
#[test]
fn a_client_gone_before_its_large_reads_are_answered_ends_only_its_connection() {
    let node = MemNodeProcess::start("16M");
    let ctl = node.control();
    let baseline = ctl.stats().unwrap().open;
    let rkey = node.tcp_qp().regions()[0].rkey;
    for _ in 0..20 {
        let mut s = TcpStream::connect(&node.tcp).unwrap();
        client_handshake(&mut s, ConnKind::Verbs, &node.secret, "gone", 0, &node.tcp).unwrap();
        let mut batch = Batch::new();
        for k in 0..4 {
            batch.read(RemoteAddr::new(rkey, k << 22), 4 << 20);
        }
        let mut body = Vec::new();
        wire::encode_verbs_request(&mut body, &wire::BatchHead::default(), batch.requests());
        let mut frame = wire::encode_header(FrameKind::VerbsRequest, body.len()).to_vec();
        frame.extend_from_slice(&body);
        s.write_all(&frame).unwrap();
        // Gone at once (dropped), with 16 MiB of answer still to send: the node's sends meet
        // a reset.
    }
    assert_open_back_to(
        &ctl,
        &baseline,
        Duration::from_secs(10),
        "the gone clients'",
    );
    let qp = node.tcp_qp();
    let big = qp
        .read(RemoteAddr::new(rkey, 0), 4 << 20)
        .expect("the node still serves");
    assert_eq!(big.len(), 4 << 20);
}

/// Without RDMA (this build, or a node started without --rdma-device) every way in says so.
#[test]
fn rdma_where_there_is_none_is_a_clear_error() {
    let node = MemNodeProcess::start("16M");
    // A node without --rdma-device refuses rdma clients in the handshake, with the reason.
    let mut s = TcpStream::connect(&node.tcp).unwrap();
    let e = client_handshake(&mut s, ConnKind::Rdma, &node.secret, "t", 0, &node.tcp).unwrap_err();
    assert!(e.to_string().contains("serves no RDMA clients"), "{e}");
    if cfg!(feature = "rdma") {
        // With the feature, a missing device is named (the host has none: the guest has rxe0).
        let e = rackfs_verbs::rdma::connect(&node.tcp, &node.secret, "t", 0, Some("nosuchdev0"))
            .unwrap_err();
        assert!(
            e.to_string().contains("no RDMA device named nosuchdev0"),
            "{e}"
        );
    } else {
        let e = rackfs_verbs::rdma::connect(&node.tcp, &node.secret, "t", 0, None).unwrap_err();
        assert!(e.to_string().contains("--features rdma"), "{e}");
        let out = std::process::Command::new(bin_path("rackfs-memnode"))
            .args([
                "--region",
                "16M",
                "--listen",
                "127.0.0.1:0",
                "--secret-file",
            ])
            .arg(&node.secret_file)
            .args(["--rdma-device", "mlx5_0"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        // This build's daemon says the feature is missing (one built with it names the device).
        assert!(
            err.contains("RDMA: this build has no RDMA support")
                || err.contains("RDMA: no RDMA device named mlx5_0"),
            "{err}"
        );
    }
}

#[test]
fn daemon_rejects_bad_arguments_with_clear_messages() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(bin_path("rackfs-memnode"))
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let dir = rackfs_tests::TempDir::new("args");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, Secret::generate().expose()).unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "  \n").unwrap();
    let sf = secret.to_str().unwrap();
    assert!(run(&[
        "--region",
        "12Q",
        "--secret-file",
        sf,
        "--listen",
        "127.0.0.1:0"
    ])
    .contains("unknown unit"));
    assert!(run(&[
        "--region",
        "100K",
        "--secret-file",
        sf,
        "--listen",
        "127.0.0.1:0"
    ])
    .contains("at least 1 MiB"));
    assert!(run(&[
        "--region",
        "8M",
        "--secret-file",
        "/nonexistent/s",
        "--listen",
        "127.0.0.1:0"
    ])
    .contains("cannot read secret file"));
    assert!(run(&[
        "--region",
        "8M",
        "--secret-file",
        empty.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0"
    ])
    .contains("secret is empty"));
    assert!(run(&["--region", "8M", "--secret-file", sf]).contains("nothing to listen on"));
    assert!(run(&[
        "--region",
        "8M",
        "--secret-file",
        sf,
        "--listen",
        "256.0.0.1:1"
    ])
    .contains("cannot listen on"));
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let node = MemNodeProcess::start("8M");
    let sock = node.shm.clone();
    assert!(sock.exists());
    let _qp = node.tcp_qp();
    let code = node.stop();
    assert_eq!(code, Some(0));
    assert!(!sock.exists(), "the Unix socket is removed");
}

#[test]
fn baseline_lock_server_is_refused_unless_asked_for() {
    use rackfs_proto::control::ControlRequest;
    let node = MemNodeProcess::start("8M");
    let lock = ControlRequest::BaselineRangeLock {
        space: 7,
        l: 0,
        r: 100,
    };
    match node.control().call(&lock) {
        Err(RpcError::Refused {
            code: ErrorCode::Invalid,
            message,
        }) => assert!(message.contains("--baseline-lock-server"), "{message}"),
        other => panic!("a production node served the baseline lock RPC: {other:?}"),
    }
}

#[test]
fn another_protocol_version_is_refused_by_name() {
    use rackfs_proto::control::{ControlRequest, PROTOCOL_VERSION};
    let node = MemNodeProcess::start("8M");
    let c = node.control(); // said hello with this build's version: accepted
    c.call(&ControlRequest::Ping).unwrap();
    let other = PROTOCOL_VERSION + 1;
    match c.hello(other) {
        Err(e @ RpcError::Version { ours, theirs, .. }) => {
            assert_eq!((ours, theirs), (other, PROTOCOL_VERSION));
            assert_eq!(e.errno(), libc::EPROTO);
            assert!(e.to_string().contains("protocol version"), "{e}");
        }
        r => panic!("a node accepted protocol version {other}: {r:?}"),
    }
    // Nothing more is served on that connection, with a message naming both versions.
    match c.call(&ControlRequest::Ping) {
        Err(RpcError::Refused {
            code: ErrorCode::Version,
            message,
        }) => assert!(
            message.contains(&format!("{PROTOCOL_VERSION}"))
                && message.contains(&format!("{other}")),
            "{message}"
        ),
        r => panic!("served after a version mismatch: {r:?}"),
    }
}

#[test]
fn rpc_range_lock_server_excludes_overlaps_and_frees_dead_sessions() {
    use rackfs_proto::control::ControlRequest;
    let node = MemNodeProcess::start_with("8M", Secret::generate(), &["--baseline-lock-server"]);
    let a = node.control();
    let b = node.control();
    a.call(&ControlRequest::BaselineRangeLock {
        space: 7,
        l: 0,
        r: 100,
    })
    .unwrap();
    b.call(&ControlRequest::BaselineRangeLock {
        space: 7,
        l: 100,
        r: 200,
    })
    .unwrap(); // disjoint: granted
    b.call(&ControlRequest::BaselineRangeLock {
        space: 8,
        l: 0,
        r: 100,
    })
    .unwrap(); // other space: granted
    let waiter = std::thread::spawn(move || {
        b.call(&ControlRequest::BaselineRangeLock {
            space: 7,
            l: 50,
            r: 60,
        })
        .unwrap();
        b
    });
    std::thread::sleep(Duration::from_millis(100));
    assert!(!waiter.is_finished(), "an overlapping request waits");
    drop(a); // the holder's session ends: its ranges are released
    let b = waiter.join().unwrap();
    assert!(matches!(
        b.call(&ControlRequest::BaselineRangeUnlock {
            space: 7,
            l: 0,
            r: 100
        }),
        Err(RpcError::Refused {
            code: ErrorCode::NotFound,
            ..
        })
    ));
    b.call(&ControlRequest::BaselineRangeUnlock {
        space: 7,
        l: 50,
        r: 60,
    })
    .unwrap();
}

/// One control connection carries calls from several threads at once: while one of its calls
/// waits on the node (a range held by another session), the same client's other calls are
/// answered, and the waiting call completes once the range is free. (On a connection served
/// one request at a time the pings queue behind the lock and time out.)
#[test]
fn a_waiting_call_holds_up_no_other_call_on_the_same_connection() {
    use rackfs_proto::control::{ControlRequest, ControlResponse};
    let node = MemNodeProcess::start_with("8M", Secret::generate(), &["--baseline-lock-server"]);
    let holder = node.control();
    let client = std::sync::Arc::new(node.control());
    let range = ControlRequest::BaselineRangeLock {
        space: 3,
        l: 0,
        r: 10,
    };
    holder.call(&range).unwrap();
    let waiter = {
        let c = client.clone();
        let range = range.clone();
        std::thread::spawn(move || c.call(&range))
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(!waiter.is_finished(), "the overlapping lock waits");
    client.set_deadline(Duration::from_secs(2));
    let pingers: Vec<_> = (0..4)
        .map(|_| {
            let c = client.clone();
            std::thread::spawn(move || (0..50).map(|_| c.call(&ControlRequest::Ping)).collect())
        })
        .collect();
    for p in pingers {
        let answers: Vec<_> = p.join().unwrap();
        for a in answers {
            assert!(
                matches!(a, Ok(ControlResponse::Pong)),
                "a ping behind a waiting call: {a:?}"
            );
        }
    }
    assert!(!waiter.is_finished(), "the lock still waits for its holder");
    holder
        .call(&ControlRequest::BaselineRangeUnlock {
            space: 3,
            l: 0,
            r: 10,
        })
        .unwrap();
    assert!(matches!(waiter.join().unwrap(), Ok(ControlResponse::Ok)));
    // The connection still serves in order after the concurrent calls.
    assert!(matches!(
        client.call(&ControlRequest::Ping),
        Ok(ControlResponse::Pong)
    ));
}

/// Calls that pile up behind a stopped node time out one by one and leave the connection
/// whole: a call still waiting to send when its deadline passes sends nothing and says
/// `Timeout` (it once broke the connection for everyone), and once the node resumes the same
/// client is answered again.
#[test]
fn calls_stuck_behind_a_stopped_node_time_out_and_the_connection_survives() {
    use rackfs_proto::control::{ControlRequest, ControlResponse};
    let node = MemNodeProcess::start("8M");
    // Over the node's Unix socket, whose buffer is smaller than a request.
    let client = std::sync::Arc::new(
        rackfs_proto::ControlClient::connect_unix(
            std::path::Path::new(&node.shm),
            &node.secret,
            "stuck",
        )
        .unwrap(),
    );
    let pid = node.child.id() as i32;
    rackfs_tests::stop_process(pid);
    // A large request fills the socket's buffer, so its sender blocks (for its 1.5 s); calls
    // made meanwhile with a shorter deadline wait to send until past theirs.
    let send = |seq: u64| {
        let c = client.clone();
        std::thread::spawn(move || {
            c.call(&ControlRequest::Mirror {
                primary: 9,
                seq,
                last: false,
                piece: vec![7; 1 << 20],
            })
        })
    };
    client.set_deadline(Duration::from_millis(1500));
    let first = send(0);
    std::thread::sleep(Duration::from_millis(200));
    client.set_deadline(Duration::from_millis(300));
    let later: Vec<_> = (1..4).map(send).collect();
    for s in std::iter::once(first).chain(later) {
        match s.join().unwrap() {
            Err(RpcError::Timeout { .. }) => {}
            other => panic!("a call to a stopped node: {other:?}"),
        }
    }
    // SAFETY: SIGCONT to the memory node process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    client.set_deadline(Duration::from_secs(5));
    assert!(
        matches!(
            client.call(&ControlRequest::Ping),
            Ok(ControlResponse::Pong)
        ),
        "the connection did not survive the timeouts"
    );
}

/// A stopped node does not execute, once resumed, even the *first* batch of a connection that
/// reached it after the batch's deadline: the handshake gave the connection its first clock
/// sample, so that batch is judged late too (it used to set the connection's clock offset
/// itself, and ran).
#[test]
fn the_first_batch_of_a_connection_is_not_executed_after_its_deadline() {
    let node = MemNodeProcess::start("8M");
    let (region, at) = node.control().alloc(4096, 4096).unwrap();
    let qp = rackfs_verbs::tcp::connect_with(
        &node.tcp,
        &node.secret,
        "late",
        rackfs_verbs::tcp::TcpOptions {
            deadline: Duration::from_millis(300),
            ..Default::default()
        },
    )
    .unwrap();
    let pid = node.child.id() as i32;
    rackfs_tests::stop_process(pid);
    let err = qp
        .write(RemoteAddr::new(region.rkey, at), b"late!")
        .unwrap_err();
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(err.to_string().contains("300ms"), "{err}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        node.tcp_qp()
            .read(RemoteAddr::new(region.rkey, at), 5)
            .unwrap(),
        [0u8; 5],
        "the late first batch was executed ({err}); node log: {}",
        node.stderr()
    );
}

/// Fencing a token stops every data connection opened under it, whatever it is doing: two
/// threads per transport (shm, tcp) write in a loop; once `Fence` returns, no further write of
/// theirs lands (the node's copy of their counter word stops moving), their next batches fail,
/// new connections under the token are refused, and connections under other tokens go on.
/// Twenty rounds, each with a fresh token.
#[test]
fn once_a_token_is_fenced_none_of_its_batches_lands() {
    use rackfs_proto::control::{ControlRequest, ControlResponse};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let node = MemNodeProcess::start("8M");
    let ctl = node.control();
    let (region, base) = ctl.alloc(4096, 4096).unwrap();
    for round in 0..20u64 {
        let token = 1000 + round;
        let qps = [
            rackfs_verbs::shm::connect_fenced(&node.shm, &node.secret, "w", token).unwrap(),
            rackfs_verbs::tcp::connect_with(
                &node.tcp,
                &node.secret,
                "w",
                rackfs_verbs::tcp::TcpOptions {
                    fence: token,
                    ..Default::default()
                },
            )
            .unwrap(),
        ];
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = qps
            .iter()
            .enumerate()
            .flat_map(|(i, qp)| (0..2).map(move |t| (i * 2 + t, qp.clone())))
            .map(|(w, qp)| {
                let stop = stop.clone();
                let at = RemoteAddr::new(region.rkey, base + w as u64 * 8);
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        match qp.write(at, &(n + 1).to_le_bytes()) {
                            Ok(()) => n += 1,
                            Err(e) => return (n, Some(e)),
                        }
                    }
                    (n, None)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            ctl.call(&ControlRequest::Fence { token }).unwrap(),
            ControlResponse::Ok
        );
        let reader = node.tcp_qp();
        let words = || {
            let b = reader.read(RemoteAddr::new(region.rkey, base), 32).unwrap();
            (0..4)
                .map(|i| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap()))
                .collect::<Vec<_>>()
        };
        let at_fence = words();
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            words(),
            at_fence,
            "round {round}: a write landed after the fence"
        );
        stop.store(true, Ordering::SeqCst);
        for (w, h) in writers.into_iter().enumerate() {
            let (done, err) = h.join().unwrap();
            assert!(err.is_some(), "round {round}: writer {w} was never refused");
            // A write refused only in its answer may have landed: at most one per writer.
            assert!(done + 1 >= at_fence[w], "round {round}: writer {w}");
        }
        let again = rackfs_verbs::shm::connect_fenced(&node.shm, &node.secret, "w", token);
        assert!(
            again.is_err_and(|e| e.to_string().contains("fenced")),
            "round {round}: a new connection under a fenced token"
        );
        node.shm_qp()
            .write(RemoteAddr::new(region.rkey, base + 64), b"others go on")
            .unwrap();
    }
}

/// A primary's frees for one node in one request: each extent freed only under its owner tag,
/// the ones the node does not hold so named back (and the rest freed); too many at once is
/// refused whole, saying how many it may name.
#[test]
fn frees_in_one_request_free_each_tagged_extent_and_name_the_rest() {
    use rackfs_proto::link::ControlLink;
    let node = MemNodeProcess::start("4M");
    let ctl = node.control();
    let tags = [0x101, 0x102, 0x103];
    let at: Vec<u64> = tags
        .iter()
        .map(|&t| ctl.alloc_tagged(64 << 10, 4096, Some(t)).unwrap().1)
        .collect();
    let refused = ctl
        .free_many(vec![(at[0], tags[0]), (at[1], tags[0]), (at[2], tags[2])])
        .unwrap();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].0, at[1], "the extent named under another's tag");
    let again = ctl
        .free_many(vec![(at[0], tags[0]), (at[2], tags[2])])
        .unwrap();
    assert_eq!(again.len(), 2, "both were freed the first time: {again:?}");
    ctl.free(at[1], Some(tags[1]))
        .expect("the extent named under another's tag was kept");
    match ctl.free_many(vec![(at[0], tags[0]); 1025]) {
        Err(RpcError::Refused {
            code: ErrorCode::Invalid,
            message,
        }) => assert!(message.contains("at most 1024"), "{message}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}
