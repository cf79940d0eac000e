// rightsload: the simulated runners of benchmarks/bench_rights_failover.py in one Go
// process, one goroutine per runner, each running the port of the shipped RightKeeper
// (keeper.go) over real HTTP to the endpoint the benchmark names.
//
//	rightsload -spec SPEC.json -seconds D [-started]   # commands on stdin, JSON lines
//	rightsload script < scenario.json                  # one keeper over a fake clock
//
// The commands and their answers are Fleet.command's (the Python client), one JSON array
// per line in, one JSON value per line out. Times the benchmark sends (epoch,
// granted_since) and those this program reports are seconds on CLOCK_MONOTONIC, the
// clock of Python's time.monotonic(): see now().
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"
)

// ---- the clock -------------------------------------------------------------------------

var (
	monoAnchor float64   // CLOCK_MONOTONIC at anchorAt, in seconds
	anchorAt   time.Time // carries Go's monotonic reading
)

// clockMonotonic reads CLOCK_MONOTONIC (1) with the raw syscall (no x/sys in stdlib).
func clockMonotonic() float64 {
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, 1,
		uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		fatal("clock_gettime(CLOCK_MONOTONIC): %v", errno)
	}
	return float64(ts.Sec) + float64(ts.Nsec)/1e9
}

func anchorClock() {
	anchorAt = time.Now()
	monoAnchor = clockMonotonic()
}

// now: seconds on CLOCK_MONOTONIC, as Python's time.monotonic() and asyncio's loop.time()
// read it. Go's own monotonic clock is CLOCK_MONOTONIC on Linux, so one anchor taken at
// the start stays exact; only differences of Go's clock are added to it (cheap: no
// syscall per reading).
func now() float64 { return monoAnchor + time.Since(anchorAt).Seconds() }

func sleepUntil(at float64) {
	if d := at - now(); d > 0 {
		time.Sleep(time.Duration(d * 1e9))
	}
}

func fatal(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "rightsload: "+format+"\n", args...)
	os.Exit(2)
}

// ---- the fleet ---------------------------------------------------------------------------

type runner struct {
	keeper     *Keeper
	source     net.IP
	firstAfter float64 // valid if hasFirst: arrival of the first grant asked at/after the epoch
	hasFirst   bool
	lapsedAt   float64 // valid if hasLapsed: a deadline that passed with no grant since the epoch
	hasLapsed  bool
	lastStatus int // the last answer's status in the current ask (0: none); its goroutine's
}

type tally struct {
	asks      int
	codes     map[int]int
	latencies []float64
	lag       []float64
}

func newTally() tally { return tally{codes: map[int]int{}} }

// Fleet is Fleet (the Python client process), for all runners.
type Fleet struct {
	seconds float64
	runners []*runner

	mu        sync.Mutex // everything below, and the runners' report fields
	endpoint  *net.TCPAddr
	host      string // the endpoint as the benchmark named it (the Host header)
	dead      map[int]bool
	style     string
	epoch     float64
	hasEpoch  bool
	tally     tally
	running   bool
	resume    chan struct{} // closed at a resume
	pausedAt  float64
	resumedAt float64
	cpu0      float64
	started   bool // "go" received
}

type spec [5]string // namespace, VM, pod uid, token file, source address

func newFleet(specs []spec, seconds float64, started bool) *Fleet {
	f := &Fleet{seconds: seconds, dead: map[int]bool{}, style: "new", tally: newTally(),
		running: true, resume: make(chan struct{}), cpu0: cpuSeconds()}
	rng := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	jitterMu := sync.Mutex{}
	jitter := func(low, high float64) float64 { // random.uniform
		jitterMu.Lock()
		defer jitterMu.Unlock()
		return low + (high-low)*rng.Float64()
	}
	for _, s := range specs {
		r := &runner{source: net.ParseIP(s[4])}
		if r.source == nil {
			fatal("source address %q of %s/%s", s[4], s[0], s[1])
		}
		post := func(target string, body []byte, auth string, timeout float64) (int, []byte, error) {
			status, answer, err := f.post(r, target, body, auth, timeout)
			r.lastStatus = status
			if err != nil {
				r.lastStatus = 0
			}
			return status, answer, err
		}
		// The token is read once, here (the Python keeper re-reads it at every ask; the
		// benchmark's token files never change while it runs).
		token, err := os.ReadFile(s[3])
		if err != nil {
			r.keeper = NewKeeperNoToken(seconds, s[0], s[1], s[2], err.Error(), now, post, jitter)
		} else {
			r.keeper = NewKeeper(seconds, s[0], s[1], s[2], token, now, post, jitter)
		}
		if started {
			r.keeper.GuestStarted()
		}
		f.runners = append(f.runners, r)
	}
	return f
}

// start is main() after "go": every runner's first ask a random moment of the first D/3.
func (f *Fleet) start() {
	begin := now()
	for _, r := range f.runners {
		go f.run(r, begin+rand.Float64()*f.seconds/3)
	}
	go f.tick(0.1)
}

// run is Fleet.run: ask at each next_ask; a pause slides the schedule.
func (f *Fleet) run(r *runner, at float64) {
	for {
		sleepUntil(at)
		f.mu.Lock()
		running, resume, pausedAt := f.running, f.resume, f.pausedAt
		f.mu.Unlock()
		if !running {
			<-resume
			f.mu.Lock()
			resumedAt := f.resumedAt
			f.mu.Unlock()
			at += resumedAt - min(pausedAt, at) // the schedule slides, spread
			continue
		}
		t0 := f.ask(r)
		at = r.keeper.NextAsk(t0)
	}
}

func (f *Fleet) tick(period float64) {
	for {
		t := now()
		time.Sleep(time.Duration(period * 1e9))
		lag := now() - t - period
		f.mu.Lock()
		f.tally.lag = append(f.tally.lag, lag)
		f.mu.Unlock()
	}
}

// ask is Fleet.ask: one ask_once, tallied; the epoch's measures on a grant.
func (f *Fleet) ask(r *runner) float64 {
	k := r.keeper
	before, hadBefore := k.Deadline()
	r.lastStatus = 0
	t0 := k.AskOnce()
	end := now()
	f.mu.Lock()
	defer f.mu.Unlock()
	f.tally.asks++
	f.tally.codes[r.lastStatus]++
	f.tally.latencies = append(f.tally.latencies, end-t0)
	if last, ok := k.LastGrant(); !ok || last != t0 {
		return t0
	}
	if !k.SaysStarted() {
		k.GuestStarted() // QEMU starts after the first grant (SelfFence.arm)
	}
	if f.hasEpoch {
		if hadBefore && end > before && before > f.epoch && !r.hasLapsed && !r.hasFirst {
			r.lapsedAt, r.hasLapsed = before, true
		}
		if t0 >= f.epoch && !r.hasFirst {
			r.firstAfter, r.hasFirst = end, true
		}
	}
	return t0
}

var errRefused = fmt.Errorf("no live endpoint") // what a connect would get
var errNoTime = fmt.Errorf("no time left")

// post is Fleet.post and Fleet._exchange: one POST on a new connection from the runner's
// own address to the endpoint named now, within timeout seconds overall.
func (f *Fleet) post(r *runner, target string, body []byte, auth string,
	timeout float64) (int, []byte, error) {
	f.mu.Lock()
	endpoint, host, style := f.endpoint, f.host, f.style
	dead := endpoint != nil && f.dead[endpoint.Port]
	f.mu.Unlock()
	if endpoint == nil || dead {
		return 0, nil, errRefused
	}
	if timeout <= 0 {
		return 0, nil, errNoTime
	}
	if style != "new" {
		target, _, _ = strings.Cut(target, "?") // a runner of the release before
	}
	deadline := time.Now().Add(time.Duration(timeout * 1e9))
	dialer := net.Dialer{LocalAddr: &net.TCPAddr{IP: r.source}, Deadline: deadline}
	conn, err := dialer.Dial("tcp", endpoint.String())
	if err != nil {
		return 0, nil, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(deadline); err != nil {
		return 0, nil, err
	}
	head := "POST " + target + " HTTP/1.1\r\nHost: " + host +
		"\r\nContent-Type: application/json\r\nAuthorization: " + auth +
		"\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\nConnection: close\r\n\r\n"
	if _, err := conn.Write(append([]byte(head), body...)); err != nil {
		return 0, nil, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	if err != nil {
		return 0, nil, err
	}
	return resp.StatusCode, data, nil
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return float64(ru.Utime.Sec) + float64(ru.Utime.Usec)/1e6 +
		float64(ru.Stime.Sec) + float64(ru.Stime.Usec)/1e6
}

// percentile is neonvm.drills.observer.percentile (nearest rank; Python's round is
// half to even); 0 for no values (the Fleet's `or 0.0`).
func percentile(values []float64, q float64) float64 {
	if len(values) == 0 {
		return 0
	}
	ordered := slices.Clone(values)
	slices.Sort(ordered)
	i := int(math.RoundToEven(q*float64(len(ordered))+0.5)) - 1
	return ordered[min(len(ordered)-1, max(0, i))]
}

// command is Fleet.command; the answer (nil: none) is written as one JSON line.
func (f *Fleet) command(message []json.RawMessage) any {
	var kind string
	if len(message) == 0 || json.Unmarshal(message[0], &kind) != nil {
		fatal("bad command %s", message)
	}
	arg := func(into any) {
		if len(message) < 2 || json.Unmarshal(message[1], into) != nil {
			fatal("bad argument of %s", kind)
		}
	}
	switch kind {
	case "endpoint":
		var ep *[2]json.RawMessage
		arg(&ep)
		f.mu.Lock()
		defer f.mu.Unlock()
		if ep == nil {
			f.endpoint, f.host = nil, ""
			return nil
		}
		var host string
		var port int
		if json.Unmarshal(ep[0], &host) != nil || json.Unmarshal(ep[1], &port) != nil {
			fatal("bad endpoint %s", message[1])
		}
		addr, err := net.ResolveTCPAddr("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			fatal("endpoint %s: %v", message[1], err)
		}
		f.endpoint, f.host = addr, host+":"+strconv.Itoa(port)
	case "go":
		f.mu.Lock()
		first := !f.started
		f.started = true
		f.mu.Unlock()
		if first {
			f.start()
		}
	case "dead", "alive":
		var port int
		arg(&port)
		f.mu.Lock()
		if kind == "dead" {
			f.dead[port] = true
		} else {
			delete(f.dead, port)
		}
		f.mu.Unlock()
	case "style":
		var style string
		arg(&style)
		f.mu.Lock()
		f.style = style
		f.mu.Unlock()
	case "epoch":
		var epoch *float64
		arg(&epoch)
		f.mu.Lock()
		f.hasEpoch = epoch != nil
		if epoch != nil {
			f.epoch = *epoch
		}
		for _, r := range f.runners {
			r.hasFirst, r.hasLapsed = false, false
		}
		f.mu.Unlock()
	case "report":
		t := now()
		f.mu.Lock()
		defer f.mu.Unlock()
		epoch := 0.0
		if f.hasEpoch {
			epoch = f.epoch // Python: self.epoch or 0.0
		}
		g := make([]*float64, len(f.runners))
		lapsed := 0
		for i, r := range f.runners {
			if r.hasFirst {
				v := r.firstAfter - epoch
				g[i] = &v
			}
			deadline, _ := r.keeper.Deadline() // (deadline or 0)
			if r.hasLapsed || (!r.hasFirst && deadline < t) {
				lapsed++
			}
		}
		return map[string]any{"g": g, "lapsed": lapsed}
	case "granted_since":
		var since float64
		arg(&since)
		count := 0
		for _, r := range f.runners {
			last, ok := r.keeper.LastGrant()
			if !ok {
				last = -1
			}
			if last >= since {
				count++
			}
		}
		return count
	case "stats":
		f.mu.Lock()
		t := f.tally
		f.tally = newTally()
		cpu := cpuSeconds()
		used := cpu - f.cpu0
		f.cpu0 = cpu
		f.mu.Unlock()
		codes := map[string]int{}
		for c, n := range t.codes {
			codes[strconv.Itoa(c)] = n
		}
		latencies := t.latencies
		if latencies == nil {
			latencies = []float64{}
		}
		return []any{t.asks, codes, latencies, percentile(t.lag, 0.99), used}
	case "pause":
		f.mu.Lock()
		f.pausedAt = now()
		if f.running {
			f.running = false
			f.resume = make(chan struct{})
		}
		f.mu.Unlock()
	case "resume":
		f.mu.Lock()
		f.resumedAt = now()
		if !f.running {
			f.running = true
			close(f.resume)
		}
		f.mu.Unlock()
	case "stop":
		os.Exit(0)
	default:
		fatal("unknown command %q", kind)
	}
	return nil
}

var answered = map[string]bool{"report": true, "granted_since": true, "stats": true}

func serve(f *Fleet) {
	in := bufio.NewReaderSize(os.Stdin, 1<<16)
	out := bufio.NewWriter(os.Stdout)
	for {
		line, err := in.ReadBytes('\n')
		if len(strings.TrimSpace(string(line))) > 0 {
			var message []json.RawMessage
			if json.Unmarshal(line, &message) != nil {
				fatal("bad command line %q", line)
			}
			answer := f.command(message)
			var kind string
			_ = json.Unmarshal(message[0], &kind)
			if answered[kind] {
				data, err := json.Marshal(answer)
				if err != nil {
					fatal("answer to %s: %v", kind, err)
				}
				out.Write(append(data, '\n'))
				if err := out.Flush(); err != nil {
					os.Exit(0) // the benchmark is gone
				}
			}
		}
		if err != nil {
			os.Exit(0) // stdin closed: the benchmark is gone
		}
	}
}

// ---- script mode: one keeper over a fake clock (the parity test) -----------------------

type scriptAnswer struct {
	Latency float64 `json:"latency"`
	Status  int     `json:"status"`
	Body    string  `json:"body"`
	Error   string  `json:"error"` // "refused", "timeout" or "" (an answer)
}

type scenario struct {
	Seconds float64        `json:"seconds"`
	Started bool           `json:"started"`
	Start   float64        `json:"start"`
	Token   string         `json:"token"`
	Jitter  []float64      `json:"jitter"` // jitter(low, high) = low + (high-low)*u, in turn
	Answers []scriptAnswer `json:"answers"`
	// The driver, as Fleet.ask: once an ask is granted, later asks say the guest started.
	StartOnGrant bool `json:"start_on_grant"`
	MaxAsks      int  `json:"max_asks"` // 0: until the answers run out
}

type sendRecord struct {
	At      float64 `json:"at"`
	Timeout float64 `json:"timeout"`
	Target  string  `json:"target"`
	Body    string  `json:"body"`
	Auth    string  `json:"auth"`
}

type askRecord struct {
	T0        float64      `json:"t0"`
	Deadline  *float64     `json:"deadline"`
	Next      float64      `json:"next"`
	LastGrant *float64     `json:"last_grant"`
	Condemned bool         `json:"condemned"`
	Sends     []sendRecord `json:"sends"`
}

// script: asks while scripted answers remain; an answer takes its latency of the fake
// clock unless that is past the send's timeout (then it is a timeout, at the timeout);
// "timeout" takes the whole timeout, "refused" its latency. One JSON line per ask.
func script() {
	var sc scenario
	if err := json.NewDecoder(os.Stdin).Decode(&sc); err != nil {
		fatal("scenario: %v", err)
	}
	clock := sc.Start
	next := 0
	var sends []sendRecord
	jitters := sc.Jitter
	post := func(target string, body []byte, auth string, timeout float64) (int, []byte, error) {
		if next >= len(sc.Answers) {
			fatal("the scenario ran out of answers within an ask")
		}
		a := sc.Answers[next]
		next++
		sends = append(sends, sendRecord{clock, timeout, target, string(body), auth})
		wait := max(0, timeout)
		if a.Error == "timeout" || a.Latency > wait {
			clock += wait
			return 0, nil, fmt.Errorf("timed out")
		}
		clock += a.Latency
		if a.Error == "refused" {
			return 0, nil, errRefused
		}
		return a.Status, []byte(a.Body), nil
	}
	jitter := func(low, high float64) float64 {
		if len(jitters) == 0 {
			fatal("the scenario ran out of jitter values")
		}
		u := jitters[0]
		jitters = jitters[1:]
		return low + (high-low)*u
	}
	k := NewKeeper(sc.Seconds, "ns", "vm", "uid-1", []byte(sc.Token), func() float64 { return clock },
		post, jitter)
	if sc.Started {
		k.GuestStarted()
	}
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	enc := json.NewEncoder(out)
	for asks := 0; next < len(sc.Answers) && (sc.MaxAsks == 0 || asks < sc.MaxAsks); asks++ {
		sends = []sendRecord{}
		t0 := k.AskOnce()
		if last, ok := k.LastGrant(); sc.StartOnGrant && ok && last == t0 {
			k.GuestStarted()
		}
		at := k.NextAsk(t0)
		rec := askRecord{T0: t0, Next: at, Condemned: k.Condemned(), Sends: sends}
		if d, ok := k.Deadline(); ok {
			rec.Deadline = &d
		}
		if g, ok := k.LastGrant(); ok {
			rec.LastGrant = &g
		}
		if err := enc.Encode(rec); err != nil {
			fatal("%v", err)
		}
		clock = max(clock, at)
	}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "script" {
		script()
		return
	}
	flags := flag.NewFlagSet("rightsload", flag.ExitOnError)
	specPath := flags.String("spec", "", "JSON list of [namespace, vm, pod uid, token file, source address]")
	seconds := flags.Float64("seconds", 0, "D: the right's seconds")
	started := flags.Bool("started", false, "every runner's guest has started (its asks say so)")
	_ = flags.Parse(os.Args[1:])
	if *specPath == "" || *seconds <= 0 || flags.NArg() > 0 {
		fatal("usage: rightsload -spec SPEC.json -seconds D [-started] | rightsload script")
	}
	data, err := os.ReadFile(*specPath)
	if err != nil {
		fatal("%v", err)
	}
	var specs []spec
	if err := json.Unmarshal(data, &specs); err != nil {
		fatal("spec %s: %v", *specPath, err)
	}
	anchorClock()
	serve(newFleet(specs, *seconds, *started))
}
