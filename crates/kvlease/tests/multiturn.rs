//! Multi-turn (SPEC §6, B1–B4) over real processes: P and D started with
//! `bidirectional_kv_xfer`, `kvlease proxy` in front remembering each conversation's cached turn
//! by its top-level `conversation_id`, a single local engine computing every turn's whole
//! conversation for comparison (D7). Faults: D killed between turns, D's TTL passed, a history
//! that no longer extends the cached turn, another conversation's turn, a busy P holding the next
//! turn past the TTL (B3), P paused under its read of D's blocks.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const MODEL: &str = "kvlease-synthetic";

/// A conversation's API: completions (the history is one growing prompt) or chat (a list of
/// messages), streamed or not.
#[derive(Clone, Copy, Debug)]
struct Api {
    chat: bool,
    stream: bool,
}

impl Api {
    fn path(self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }
}

/// A conversation as a client keeps it: the history so far, which the next turn extends with
/// the reply it got and a new user message.
struct Conversation {
    id: String,
    api: Api,
    prompt: String,
    messages: Vec<Value>,
}

impl Conversation {
    fn new(id: &str, api: Api) -> Conversation {
        Conversation { id: id.into(), api, prompt: String::new(), messages: Vec::new() }
    }

    /// The user's turn `k`: long enough that the history passes the recompute threshold.
    fn say(&mut self, k: usize) {
        let text = format!("user turn {k} of {}: tell me more about the lease and the heartbeat and the cache", self.id);
        if self.api.chat {
            self.messages.push(json!({"role": "user", "content": text}));
        } else {
            self.prompt.push_str(&format!("\n{text}\n"));
        }
    }

    /// The reply, appended to the history exactly as it came back.
    fn heard(&mut self, reply: &str) {
        if self.api.chat {
            self.messages.push(json!({"role": "assistant", "content": reply}));
        } else {
            self.prompt.push_str(reply);
        }
    }

    /// The request for the next turn (greedy, so every run answers the same).
    fn request(&self, max_tokens: u64) -> Value {
        let mut b = json!({"model": MODEL, "max_tokens": max_tokens});
        if self.api.chat {
            b["messages"] = json!(self.messages);
        } else {
            b["prompt"] = json!(self.prompt);
        }
        b
    }
}

/// What one turn through the proxy gave: the reply, the cached turn D's answer named (body or
/// last SSE chunk), and the local engine's reply and prompt length for the same history.
struct Turn {
    reply: String,
    kept: Option<Value>,
    want: String,
    prompt_tokens: u64,
}

/// Sends the conversation's next turn through the proxy, with its `conversation_id`, and the
/// same history to the local engine.
async fn turn(proxy: &Proc, local: &Proc, c: &Conversation, max_tokens: u64) -> Turn {
    let body = c.request(max_tokens);
    let (status, want) = post(&format!("{}{}", local.url, c.api.path()), &body).await;
    assert_eq!(status, 200, "{want}");
    let prompt_tokens = want["usage"]["prompt_tokens"].as_u64().expect("usage.prompt_tokens");
    let want = text_of(&want, c.api.chat);
    let mut b = body;
    b["conversation_id"] = json!(c.id);
    let url = format!("{}{}", proxy.url, c.api.path());
    let (reply, kept) = if c.api.stream {
        b["stream"] = json!(true);
        post_stream_params(&url, &b, c.api.chat).await
    } else {
        let (status, got) = post(&url, &b).await;
        assert_eq!(status, 200, "{got}");
        (text_of(&got, c.api.chat), got.get("kv_transfer_params").filter(|p| p.is_object()).cloned())
    };
    Turn { reply, kept, want, prompt_tokens }
}

/// The cached turn's token count (`remote_num_tokens`).
fn cached_tokens(kept: &Value) -> u64 {
    kept["remote_num_tokens"].as_u64().unwrap_or_else(|| panic!("no remote_num_tokens in {kept}"))
}

/// P and D with bidirectional transfer (cached-turn TTL `ttl`, lease `lease`, threshold 32),
/// with these extra flags on P; a local engine; the proxy in front of P and the decoders.
fn bidirectional(tag: &str, ttl: f64, lease: f64, p_extra: &[&str]) -> (Proc, Proc, Proc) {
    let cfg = bidirectional_config(ttl, lease, 32);
    let mut p_args = vec!["--kv-transfer-config", cfg.as_str()];
    p_args.extend_from_slice(p_extra);
    let p = Proc::serve(&format!("{tag}-p"), &p_args);
    let d = Proc::serve(&format!("{tag}-d"), &["--kv-transfer-config", &cfg]);
    let local = Proc::serve(&format!("{tag}-local"), &[]);
    (p, d, local)
}

/// SPEC B1, B3, B4, D7: four-turn conversations through the proxy — completions and chat,
/// streamed and not. Every turn's reply equals the local engine's for the whole conversation;
/// D's answer names its cached turn (body or last SSE chunk); from the second turn on P reads the
/// conversation so far back from D (`kvlease_turn_tokens_read_total` grows by the cached turn's
/// tokens) and prefills only the new ones (`kvlease_prefill_tokens_total` grows by the rest). The
/// chat replies go back as assistant messages and still extend the cached prefix. D frees each
/// turn it was read as `transferred`; the last turns expire at their TTL; no block is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b1_b3_b4_d7_four_turn_conversations_through_the_proxy_read_the_history_back() {
    let (p, d, local) = bidirectional("mt", 6.0, 30.0, &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let apis = [
        Api { chat: false, stream: false },
        Api { chat: false, stream: true },
        Api { chat: true, stream: false },
        Api { chat: true, stream: true },
    ];
    let mut reads = 0.0;
    for (i, api) in apis.into_iter().enumerate() {
        let mut c = Conversation::new(&format!("conv-{i}"), api);
        let mut cached: Option<u64> = None;
        for k in 0..4 {
            c.say(k);
            let (read0, computed0) =
                (metric(&p.url, "kvlease_turn_tokens_read_total").await, metric(&p.url, "kvlease_prefill_tokens_total").await);
            let t = turn(&proxy, &local, &c, 8).await;
            assert_eq!(t.reply, t.want, "{api:?} turn {k}: D7");
            let read = metric(&p.url, "kvlease_turn_tokens_read_total").await - read0;
            let computed = metric(&p.url, "kvlease_prefill_tokens_total").await - computed0;
            let from_d = cached.unwrap_or(0) as f64;
            assert_eq!(read, from_d, "{api:?} turn {k}: P read the conversation so far from D");
            assert_eq!(computed, t.prompt_tokens as f64 - from_d, "{api:?} turn {k}: P prefilled only the new tokens");
            if k > 0 {
                reads += 1.0;
                assert!(read > 0.0 && computed > 0.0 && computed < read, "{api:?} turn {k}: read {read}, computed {computed}");
            }
            let kept = t.kept.unwrap_or_else(|| panic!("{api:?} turn {k}: D's answer names its cached turn"));
            assert_eq!(kept["do_remote_decode"], true, "{kept}");
            assert!(kept["remote_blocks_ttl_remaining"].as_f64().is_some_and(|s| s > 0.0 && s <= 6.0), "{kept}");
            assert!(kept["kvlease_signature"].is_string(), "{kept}");
            // Every token of this turn's prompt, and the reply but its last token, are kept.
            assert!(cached_tokens(&kept) >= t.prompt_tokens, "{kept}");
            cached = Some(cached_tokens(&kept));
            c.heard(&t.reply);
        }
    }
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 0.0);
    assert_eq!(metric(&proxy.url, "kvlease_proxy_turns_used_total").await, reads);
    assert_eq!(metric(&d.url, "kvlease_turns_kept_total").await, 16.0);
    until("D frees every turn P read", DEADLINE, || async {
        metric(&d.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == reads
    })
    .await;
    // P's own leases were all read by D; D still keeps the last turn of each conversation.
    until_nothing_held(&p.url, DEADLINE).await;
    assert_eq!(metric(&d.url, "kvlease_leases_active").await, 4.0);
    // Nobody continues: the last turns expire at their TTL and every block is back.
    until_nothing_held(&d.url, DEADLINE).await;
    assert_eq!(metric(&d.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 4.0);
    assert_eq!(metric(&d.url, "kvlease_lease_lost_total").await, 0.0);
}

/// Runs a first turn of `c` through the proxy; returns D's cached turn.
async fn first_turn(proxy: &Proc, local: &Proc, c: &mut Conversation) -> Value {
    c.say(0);
    let t = turn(proxy, local, c, 8).await;
    assert_eq!(t.reply, t.want, "first turn: D7");
    c.heard(&t.reply);
    t.kept.expect("D keeps the turn")
}

/// SPEC B2, B4, D7: D killed (SIGKILL) between turns. The next turn's prefill cannot read the
/// cached turn: P recomputes the whole conversation and the proxy decodes it on the other
/// decoder; the reply is the local one, and P is left holding nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b4_d7_decoder_killed_between_turns_costs_a_recompute_not_a_wrong_answer() {
    let cfg = bidirectional_config(30.0, 1.2, 32);
    let p = Proc::serve("mtkill-p", &["--kv-transfer-config", &cfg]);
    let d1 = Proc::serve("mtkill-d1", &["--kv-transfer-config", &cfg]);
    let d2 = Proc::serve("mtkill-d2", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("mtkill-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d1, &d2]);
    let mut c = Conversation::new("killed", Api { chat: true, stream: false });
    let kept = first_turn(&proxy, &local, &mut c).await;
    let (dead, alive) = if kept["remote_engine_id"] == "mtkill-d1" { (&d1, &d2) } else { (&d2, &d1) };
    assert_eq!(kept["remote_engine_id"], dead.name.as_str(), "{kept}");
    // The first turn's read ends its lease on P when D's completion arrives, a moment after the
    // reply: a kill before that leaves the lease to end otherwise, and this test is about the
    // next turn.
    until("P records the first turn's read", DEADLINE, || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == 1.0
    })
    .await;
    dead.signal("KILL");
    c.say(1);
    let t = turn(&proxy, &local, &c, 8).await;
    assert_eq!(t.reply, t.want, "D7 after the decoder that kept the turn died");
    assert_eq!(metric(&proxy.url, "kvlease_proxy_turns_used_total").await, 1.0, "P was handed the dead decoder's turn");
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 1.0);
    assert_eq!(metric(&p.url, "kvlease_turn_tokens_read_total").await, 0.0);
    assert_eq!(t.kept.as_ref().map(|k| k["remote_engine_id"].clone()), Some(json!(alive.name)), "the other decoder keeps turn 2");
    until_nothing_held(&p.url, DEADLINE).await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 2.0);
}

/// SPEC B1, B2, D7: D's TTL passes before the next turn. The proxy drops the stale turn, so the
/// next turn is prefilled whole; a router that hands the stale params to P anyway gets a
/// recompute too (declined, or fenced by D's `LeaseLost`), never garbage. D freed the turn at its
/// TTL; nothing is left on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b1_b2_d7_turn_past_its_ttl_is_recomputed_and_freed_on_d() {
    let (p, d, local) = bidirectional("mtttl", 1.5, 1.2, &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let mut c = Conversation::new("late", Api { chat: false, stream: true });
    let stale = first_turn(&proxy, &local, &mut c).await;
    until("D expires the cached turn", DEADLINE, || async {
        metric(&d.url, "kvlease_leases_released_total{reason=\"expired\"}").await == 1.0
    })
    .await;
    until_nothing_held(&d.url, DEADLINE).await;
    // Through the proxy: the turn is gone from its cache; P prefills the whole conversation.
    c.say(1);
    let t = turn(&proxy, &local, &c, 8).await;
    assert_eq!(t.reply, t.want, "D7 after the TTL");
    assert_eq!(metric(&proxy.url, "kvlease_proxy_turns_used_total").await, 0.0, "the proxy dropped the stale turn");
    assert_eq!(metric(&p.url, "kvlease_turn_tokens_read_total").await, 0.0);
    // A router that keeps stale params: the legs by hand, P handed the expired turn.
    c.heard(&t.reply);
    c.say(2);
    let body = c.request(8);
    let (_, want) = post(&format!("{}/v1/completions", local.url), &body).await;
    let mut leg = body.clone();
    leg["kv_transfer_params"] = stale;
    let (status, p_answer) = post(&format!("{}/v1/completions", p.url), &leg).await;
    assert_eq!(status, 200, "{p_answer}");
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 1.0, "the expired turn is not read");
    assert_eq!(metric(&p.url, "kvlease_turn_tokens_read_total").await, 0.0);
    let mut d_leg = body;
    d_leg["kv_transfer_params"] = p_answer["kv_transfer_params"].clone();
    let (status, got) = post(&format!("{}/v1/completions", d.url), &d_leg).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(text_of(&got, false), text_of(&want, false), "D7 with stale params");
    until_nothing_held(&p.url, DEADLINE).await;
    until_nothing_held(&d.url, DEADLINE).await;
}

/// SPEC B4, S4, D7: a next turn whose history no longer extends the cached turn (the client
/// edited an earlier message), and a turn sent under another conversation's id (so P is handed
/// that conversation's cached turn): P reads neither, prefills the whole prompt, and the replies
/// are the local ones. As the proxy hands a turn out once, nobody will read those turns: P
/// releases them on D at once (`released`), long before their 60 s TTL. P is left holding
/// nothing; D keeps only the two conversations' new turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b4_s4_d7_history_that_does_not_extend_the_cached_turn_is_recomputed_and_released() {
    let (p, d, local) = bidirectional("mtprefix", 60.0, 1.2, &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    // Edited history: the first user message changed, the reply kept.
    let mut edited = Conversation::new("edited", Api { chat: true, stream: true });
    first_turn(&proxy, &local, &mut edited).await;
    edited.messages[0]["content"] = json!("an edited first message that tells me about the lease and the heartbeat");
    edited.say(1);
    let t = turn(&proxy, &local, &edited, 8).await;
    assert_eq!(t.reply, t.want, "D7 with an edited history");
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 1.0);
    // Another conversation's turn: "theirs" is sent under "mine"'s conversation id.
    let mut mine = Conversation::new("mine", Api { chat: false, stream: false });
    first_turn(&proxy, &local, &mut mine).await;
    let mut theirs = Conversation::new("theirs", Api { chat: false, stream: false });
    theirs.say(0);
    theirs.heard(" lease lease");
    theirs.say(1);
    theirs.id = mine.id.clone();
    let t = turn(&proxy, &local, &theirs, 8).await;
    assert_eq!(t.reply, t.want, "D7 with another conversation's turn");
    assert_eq!(metric(&proxy.url, "kvlease_proxy_turns_used_total").await, 2.0, "P was handed both turns");
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 2.0);
    assert_eq!(metric(&p.url, "kvlease_turn_tokens_read_total").await, 0.0, "nothing was read");
    until_nothing_held(&p.url, DEADLINE).await;
    until("D frees the two turns nobody will read", DEADLINE, || async {
        metric(&d.url, "kvlease_leases_released_total{reason=\"released\"}").await == 2.0
    })
    .await;
    assert_eq!(metric(&d.url, "kvlease_leases_active").await, 2.0, "the new turns of both conversations");
    assert_eq!(metric(&d.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 0.0);
    assert_eq!(metric(&d.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 0.0);
}

/// SPEC B3, D7: the next turn waits on a busy P (`--max-num-seqs 1`, a slow local request
/// holding the only slot) for about 2.5 times D's `decoder_kv_blocks_ttl`. P renews D's cached
/// turn from the moment the turn enters its queue, so the blocks survive: P reads them (no
/// recompute), D frees them as `transferred`, never `expired`, and the reply is the local one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b3_next_turn_queued_on_a_busy_prefiller_past_the_ttl_keeps_the_cached_turn() {
    let ttl = Duration::from_millis(2000);
    let (p, d, local) = bidirectional("mtbusy", ttl.as_secs_f64(), 1.2, &["--max-num-seqs", "1", "--decode-ms-per-token", "100"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let mut c = Conversation::new("busy", Api { chat: true, stream: true });
    let kept = first_turn(&proxy, &local, &mut c).await;
    // Occupy P's only slot for about five seconds.
    let busy_url = format!("{}/v1/completions", p.url);
    let busy = tokio::spawn(async move {
        post(&busy_url, &json!({"model": MODEL, "prompt": "a long local request", "max_tokens": 50, "ignore_eos": true})).await
    });
    until("P busy", DEADLINE, || async { metric(&p.url, "kvlease_requests_running").await >= 1.0 }).await;
    c.say(1);
    let t0 = Instant::now();
    let t = turn(&proxy, &local, &c, 8).await;
    let waited = t0.elapsed();
    assert!(waited > ttl, "the turn waited {waited:?} on P, not past the TTL: this test proves nothing");
    assert_eq!(t.reply, t.want, "D7 after waiting on a busy P");
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 0.0, "the cached turn survived the wait");
    assert_eq!(metric(&p.url, "kvlease_turn_tokens_read_total").await, cached_tokens(&kept) as f64);
    assert!(metric(&d.url, "kvlease_lease_renewals_total").await >= 1.0, "P renewed D's turn");
    // P's completion of its read of the turn is not waited for (fenced): wait until D has it.
    until("D's turn released as transferred", DEADLINE, || async {
        metric(&d.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == 1.0
    })
    .await;
    assert_eq!(metric(&d.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 0.0);
    let (status, _) = busy.await.expect("busy request");
    assert_eq!(status, 200);
    until_nothing_held(&p.url, DEADLINE).await;
    until_nothing_held(&d.url, DEADLINE).await;
}

/// SPEC B3, P4, P5, D6, D7 with the roles swapped: P is paused (SIGSTOP) past E while it reads
/// D's cached turn (a hidden test hook holds P between its liveness check and the read). D stops
/// hearing from P and reclaims the turn; when P resumes, its read is refused or its lease found
/// lost, and it prefills the whole conversation: the reply is still the local one. Nothing is
/// left on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b3_p5_d6_prefiller_paused_under_its_read_lets_d_reclaim_and_recomputes() {
    let (p, d, local) = bidirectional("mtpause", 1.5, 1.2, &["--debug-read-delay-ms", "3000"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let mut c = Conversation::new("paused", Api { chat: false, stream: false });
    first_turn(&proxy, &local, &mut c).await;
    c.say(1);
    let next = tokio::spawn({
        let (proxy_url, local_url) = (proxy.url.clone(), local.url.clone());
        let body = c.request(8);
        let id = c.id.clone();
        async move {
            let (_, want) = post(&format!("{local_url}/v1/completions"), &body).await;
            let mut b = body;
            b["conversation_id"] = json!(id);
            let (status, got) = post(&format!("{proxy_url}/v1/completions"), &b).await;
            assert_eq!(status, 200, "{got}");
            (text_of(&got, false), text_of(&want, false))
        }
    });
    // P renews D's turn from the moment the turn enters its queue; then it holds before reading.
    until("P renews D's turn", DEADLINE, || async { metric(&d.url, "kvlease_heartbeats_received_total").await >= 1.0 }).await;
    p.signal("STOP");
    until("D reclaims the turn of the paused P", DEADLINE, || async {
        metric(&d.url, "kvlease_leases_released_total{reason=\"expired\"}").await == 1.0
    })
    .await;
    p.signal("CONT");
    let (got, want) = tokio::time::timeout(DEADLINE, next).await.expect("an answer in time").expect("turn task");
    assert_eq!(got, want, "D7 after P lost D's turn under its read");
    assert_eq!(metric(&p.url, "kvlease_turns_recomputed_total").await, 1.0);
    assert_eq!(metric(&p.url, "kvlease_turn_tokens_read_total").await, 0.0, "no byte of the reclaimed turn was used");
    assert_eq!(metric(&p.url, "kvlease_lease_lost_total").await, 1.0, "P found D's turn lost after deciding to read it");
    assert_eq!(metric(&d.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 0.0, "the turn was never read");
    // D's completions are not waited for (fenced reads): once P holds nothing, both landed.
    until_nothing_held(&p.url, DEADLINE).await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 2.0, "D read both of P's prefills");
    until_nothing_held(&d.url, DEADLINE).await;
}
