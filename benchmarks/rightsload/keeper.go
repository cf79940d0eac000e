// The keeper: a port of neonvm/runner/right.py's RightKeeper (ask_once, next_ask,
// _ask, extended, grant_of, refusal_reason) and of the contract bits of
// neonvm/api/rights.py it uses. Same schedule, same timeouts, same deadline rule;
// tests/test_rightsload_parity.py runs both over the same scripted answers.

package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"
)

// neonvm/runner/right.py
const (
	maxAnswer      = 64 * 1024 // MAX_ANSWER
	firstRetry     = 0.5       // FIRST_RETRY
	notLeaderTries = 3         // NOT_LEADER_TRIES
	retrySoonLow   = 0.5       // RETRY_SOON[0]
	retrySoonHigh  = 1.0       // RETRY_SOON[1]
)

// neonvm/api/rights.py
const (
	retryTimeout      = 2.0 // RETRY_TIMEOUT
	rightsPath        = "/v1/rights"
	guestStartedQuery = "guest=started"
	reasonNotLeader   = "NotLeader"
	reasonCondemned   = "Condemned"
)

func renewInterval(seconds float64) float64   { return seconds / 3.0 }
func requestDeadline(seconds float64) float64 { return seconds / 6.0 }

func askTarget(started bool) string {
	if started {
		return rightsPath + "?" + guestStartedQuery
	}
	return rightsPath
}

// Post sends one ask (target, body, Authorization) within timeout seconds overall:
// (status, body) or an error when no answer came.
type Post func(target string, body []byte, auth string, timeout float64) (int, []byte, error)

// Keeper is RightKeeper: the deadline and the renewer's steps (safe for use from
// several goroutines, as the Python one is from several threads).
type Keeper struct {
	Seconds float64
	body    []byte
	auth    string
	authErr string // a token that cannot be used: nothing is sent (as _authorization)
	clock   func() float64
	post    Post
	jitter  func(low, high float64) float64

	mu           sync.Mutex
	retrySoon    bool
	deadline     float64
	hasDeadline  bool
	lastGrant    float64
	hasLastGrant bool
	failures     int
	condemned    bool
	firstAsk     float64
	hasFirstAsk  bool
	asks         int
	guestStarted bool
}

// NewKeeper: token is the rights token file's content as read (it is stripped, and
// sent as "Bearer <token>", as RightKeeper does with a rights_token_file).
func NewKeeper(seconds float64, namespace, vm, podUID string, token []byte,
	clock func() float64, post Post, jitter func(low, high float64) float64) *Keeper {
	k := &Keeper{Seconds: seconds, clock: clock, post: post, jitter: jitter}
	// json.dumps(RightRequest(...).to_dict()): Python's separators and escapes.
	k.body = []byte(`{"namespace": ` + pyQuote(namespace) + `, "vm": ` + pyQuote(vm) +
		`, "podUID": ` + pyQuote(podUID) + `}`)
	stripped := bytes.Trim(token, " \t\n\r\x0b\x0c") // bytes.strip()
	switch {
	case len(stripped) == 0:
		k.authErr = "token file is empty"
	case !isASCII(stripped):
		k.authErr = "token file is not ASCII"
	default:
		k.auth = "Bearer " + string(stripped)
	}
	return k
}

// NewKeeperNoToken: the token file could not be read.
func NewKeeperNoToken(seconds float64, namespace, vm, podUID, why string,
	clock func() float64, post Post, jitter func(low, high float64) float64) *Keeper {
	k := NewKeeper(seconds, namespace, vm, podUID, []byte("x"), clock, post, jitter)
	k.auth, k.authErr = "", why
	return k
}

func isASCII(b []byte) bool {
	for _, c := range b {
		if c >= 0x80 {
			return false
		}
	}
	return true
}

// pyQuote: json.dumps(s) with ensure_ascii (Python's default).
func pyQuote(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			switch {
			case r < 0x20 || (r >= 0x80 && r < 0x10000):
				fmt.Fprintf(&b, `\u%04x`, r)
			case r >= 0x10000:
				r -= 0x10000
				fmt.Fprintf(&b, `\u%04x\u%04x`, 0xd800+(r>>10), 0xdc00+(r&0x3ff))
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}

// Deadline, LastGrant: (value, whether there is one).
func (k *Keeper) Deadline() (float64, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.deadline, k.hasDeadline
}

func (k *Keeper) LastGrant() (float64, bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.lastGrant, k.hasLastGrant
}

func (k *Keeper) Condemned() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.condemned
}

func (k *Keeper) GuestStarted() {
	k.mu.Lock()
	k.guestStarted = true
	k.mu.Unlock()
}

func (k *Keeper) SaysStarted() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.guestStarted
}

// AskOnce is ask_once: ask once; returns the t0 it was sent at.
func (k *Keeper) AskOnce() float64 {
	t0 := k.clock()
	timeout := requestDeadline(k.Seconds)
	k.mu.Lock()
	if !k.hasFirstAsk {
		k.firstAsk, k.hasFirstAsk = t0, true
	}
	if k.retrySoon && k.hasDeadline {
		timeout = min(timeout, retryTimeout)
	}
	k.mu.Unlock()
	granted, seconds, reason, soon := k.ask(timeout)
	k.mu.Lock()
	defer k.mu.Unlock()
	k.asks++
	k.retrySoon = !granted && soon
	before, hadBefore := k.deadline, k.hasDeadline
	k.deadline, k.hasDeadline = extended(before, hadBefore, t0, granted, seconds, k.Seconds)
	if granted {
		k.lastGrant, k.hasLastGrant = t0, true
		k.failures = 0
	} else {
		k.failures++
		if !hadBefore && reason == reasonCondemned {
			k.condemned = true
		}
	}
	return t0
}

// NextAsk is next_ask: when to ask next after an ask sent at t0.
func (k *Keeper) NextAsk(t0 float64) float64 {
	interval := renewInterval(k.Seconds)
	bound := requestDeadline(k.Seconds)
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.hasDeadline {
		scheduled := min(t0+interval, max(k.deadline-bound, t0+bound))
		if k.retrySoon && t0 < k.deadline {
			return min(scheduled, t0+k.jitter(retrySoonLow, retrySoonHigh))
		}
		return scheduled
	}
	shift := max(0, min(k.failures-1, 16))
	return t0 + min(interval, firstRetry*float64(int64(1)<<shift))
}

// ask is _ask: (granted, the grant's seconds, the refusal's reason or "", whether to
// ask again soon: no answer, or a 5xx), the ask bounded by timeout overall.
func (k *Keeper) ask(timeout float64) (bool, float64, string, bool) {
	if k.authErr != "" {
		return false, 0, "", false
	}
	target := askTarget(k.SaysStarted())
	end := k.clock() + timeout
	var status int
	var answer []byte
	for range notLeaderTries {
		s, a, err := k.post(target, k.body, k.auth, end-k.clock())
		if err != nil {
			return false, 0, "", true
		}
		status, answer = s, a
		if status != 503 || refusalReason(status, answer) != reasonNotLeader ||
			k.clock() >= end {
			break
		}
	}
	seconds, ok := grantOf(status, answer)
	if !ok {
		return false, 0, refusalReason(status, answer), status >= 500
	}
	return true, seconds, "", false
}

// extended: the deadline after an answer to an ask sent at t0.
func extended(deadline float64, has bool, t0 float64, granted bool, seconds, d float64) (float64, bool) {
	if !granted {
		return deadline, has
	}
	candidate := t0 + min(seconds, d)
	if !has {
		return candidate, true
	}
	return max(deadline, candidate), true
}

// pyObject: json.loads(body) as a JSON object whose keys are all in allowed (the
// RightsContractError of _object otherwise); false if it is not one.
func pyObject(body []byte, allowed ...string) (map[string]json.RawMessage, bool) {
	if !utf8.Valid(body) {
		return nil, false // UnicodeDecodeError (a UTF-16/32 body aside: never sent)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(body, &doc); err != nil || doc == nil {
		return nil, false
	}
	for key := range doc {
		found := false
		for _, a := range allowed {
			if key == a {
				found = true
			}
		}
		if !found {
			return nil, false
		}
	}
	return doc, true
}

// grantOf is grant_of: the seconds of a 200 whose body is exactly a RightGrant.
func grantOf(status int, body []byte) (float64, bool) {
	if status != 200 || len(body) > maxAnswer {
		return 0, false
	}
	doc, ok := pyObject(body, "seconds")
	if !ok {
		return 0, false
	}
	raw, ok := doc["seconds"]
	if !ok {
		return 0, false
	}
	text := strings.TrimSpace(string(raw))
	if text == "" || !(text[0] == '-' || (text[0] >= '0' && text[0] <= '9')) {
		return 0, false // not a number (a bool, a string, null, ...)
	}
	value, err := strconv.ParseFloat(text, 64)
	if (err != nil && !math.IsInf(value, 0)) || math.IsInf(value, 0) || math.IsNaN(value) ||
		value <= 0 {
		return 0, false // _positive_seconds
	}
	return value, true
}

// refusalReason is refusal_reason: the reason of a non-200 answer whose body is a
// RightRefusal, "" otherwise.
func refusalReason(status int, body []byte) string {
	if status == 200 || len(body) > maxAnswer {
		return ""
	}
	doc, ok := pyObject(body, "reason", "message")
	if !ok {
		return ""
	}
	var reason string
	if raw, ok := doc["reason"]; !ok || json.Unmarshal(raw, &reason) != nil || reason == "" {
		return ""
	}
	if raw, ok := doc["message"]; ok {
		var message string
		if json.Unmarshal(raw, &message) != nil || strings.TrimSpace(string(raw)) == "null" {
			return ""
		}
	}
	return reason
}
