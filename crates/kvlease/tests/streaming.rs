//! Streamed answers do not stall on the wire (issue 15): a client on one kept-alive connection
//! gets each SSE event as the engine makes it, on one engine and through the proxy (P → D).
//!
//! Without `TCP_NODELAY` on the server's side of a connection, the second small write of a
//! response waits for the client's ACK of the first, which a kept-alive client delays by up to
//! 40 ms (Linux's delayed-ACK timer): every streamed answer then takes ≥ 40 ms at zero compute,
//! against well under a millisecond not streamed. A fresh connection hides it (the kernel ACKs
//! at once while a connection is young), so the client here keeps one connection for the whole
//! run, as an SDK's pool does. The bounds are generous (a loaded 2-core machine): the median over
//! requests of the longest gap between two events of one answer stays under 15 ms, and the
//! streamed median latency stays within 15 ms of the non-streamed one measured in the same run.

mod common;
use common::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const REQUESTS: usize = 40;
const TOKENS: u32 = 12;
const BOUND: Duration = Duration::from_millis(15);

/// One kept-alive HTTP/1.1 connection, as a client library's pool holds it.
struct KeepAlive {
    host: String,
    out: TcpStream,
    rd: BufReader<TcpStream>,
}

/// One answer: its latency and, if streamed, when each SSE event arrived.
struct Answer {
    latency: Duration,
    events: Vec<Instant>,
    body: String,
}

impl KeepAlive {
    fn connect(url: &str) -> KeepAlive {
        let host = url.trim_start_matches("http://").to_string();
        let out = TcpStream::connect(&host).expect("connect");
        out.set_read_timeout(Some(DEADLINE)).expect("read timeout");
        let rd = BufReader::new(out.try_clone().expect("clone"));
        KeepAlive { host, out, rd }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        let n = self.rd.read_line(&mut l).expect("read");
        assert!(n > 0, "the server closed the kept-alive connection");
        l
    }

    /// POSTs one completion on this connection (one write) and reads the whole answer.
    fn complete(&mut self, i: usize, stream: bool) -> Answer {
        let body = serde_json::json!({
            "model": "kvlease-synthetic", "prompt": format!("lease heartbeat {i} prefill decode block"),
            "max_tokens": TOKENS, "ignore_eos": true, "stream": stream,
        })
        .to_string();
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.host,
            body.len()
        );
        let t0 = Instant::now();
        self.out.write_all(req.as_bytes()).expect("write");
        let status = self.line();
        assert!(status.starts_with("HTTP/1.1 200"), "{status:?}");
        let (mut length, mut chunked) = (None, false);
        loop {
            let h = self.line().to_ascii_lowercase();
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.strip_prefix("content-length:") {
                length = Some(v.trim().parse::<usize>().expect("content-length"));
            }
            chunked |= h.starts_with("transfer-encoding:") && h.contains("chunked");
        }
        let mut body = Vec::new();
        let mut events = Vec::new();
        if let Some(n) = length {
            body.resize(n, 0);
            self.rd.read_exact(&mut body).expect("body");
        } else {
            assert!(chunked, "neither Content-Length nor chunked");
            loop {
                let size = usize::from_str_radix(self.line().trim(), 16).expect("chunk size");
                let mut chunk = vec![0; size + 2];
                self.rd.read_exact(&mut chunk).expect("chunk");
                if size == 0 {
                    break;
                }
                let at = Instant::now();
                let text = String::from_utf8_lossy(&chunk[..size]).into_owned();
                events.extend(std::iter::repeat_n(at, text.matches("data:").count()));
                body.extend_from_slice(&chunk[..size]);
            }
        }
        Answer { latency: t0.elapsed(), events, body: String::from_utf8(body).expect("UTF-8") }
    }
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort_unstable();
    xs[xs.len() / 2]
}

/// Streams and does not stream `REQUESTS` answers each, alternately, on one connection; checks
/// the streamed ones arrive without stalls.
fn no_stall(what: &str, url: &str) {
    let mut c = KeepAlive::connect(url);
    let (mut plain, mut streamed, mut worst_gaps) = (vec![], vec![], vec![]);
    for i in 0..REQUESTS {
        let a = c.complete(2 * i, false);
        assert!(a.body.contains("\"choices\""), "{what}: {}", a.body);
        plain.push(a.latency);
        let s = c.complete(2 * i + 1, true);
        assert!(s.body.trim_end().ends_with("data: [DONE]"), "{what}: {}", s.body);
        // Events carrying text (a token's text may come with the next one's), the finish event
        // and [DONE].
        assert!(s.events.len() > TOKENS as usize / 2, "{what}: {} events: {}", s.events.len(), s.body);
        let worst = s.events.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
        worst_gaps.push(worst);
        streamed.push(s.latency);
    }
    let (plain, streamed, worst) = (median(plain), median(streamed), median(worst_gaps));
    eprintln!("{what}: median latency {plain:?} not streamed, {streamed:?} streamed; median longest gap {worst:?}");
    assert!(worst < BOUND, "{what}: streamed answers stall: the median longest gap between two events is {worst:?}");
    assert!(streamed < plain + BOUND, "{what}: streamed answers stall: median {streamed:?} streamed against {plain:?} not streamed");
}

#[test]
fn streamed_answers_do_not_stall_on_a_kept_alive_connection_one_engine_and_through_the_proxy() {
    let engine = Proc::serve("stream-single", &[]);
    no_stall("one engine", &engine.url);
    let p = Proc::serve("stream-p", &[]);
    let d = Proc::serve("stream-d", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    no_stall("through the proxy", &proxy.url);
}
