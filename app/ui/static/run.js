// The run page: draws the reward and loss curves as inline SVG and keeps them, the step counter,
// the status and the event list current from the run's event stream (no reload, no library).
"use strict";

(function () {
  const data = JSON.parse(document.getElementById("run-data").textContent);
  const series = { reward: new Map(data.reward), loss: new Map(data.loss) };
  const W = 600, H = 220, PAD = 20;

  function draw(id, points) {
    const svg = document.getElementById(id);
    const xs = [...points.keys()].sort((a, b) => a - b);
    const line = svg.querySelector(".line");
    if (!xs.length) { line.setAttribute("points", ""); return; }
    const ys = xs.map((x) => points.get(x));
    let lo = Math.min(...ys), hi = Math.max(...ys);
    if (hi === lo) { hi += 1; lo -= 1; }
    const x0 = xs[0], x1 = Math.max(xs[xs.length - 1], x0 + 1);
    const px = (x) => PAD + ((x - x0) / (x1 - x0)) * (W - 2 * PAD);
    const py = (y) => H - PAD - ((y - lo) / (hi - lo)) * (H - 2 * PAD);
    line.setAttribute("points", xs.map((x, i) => px(x).toFixed(1) + "," + py(ys[i]).toFixed(1)).join(" "));
    svg.querySelector(".ymax").textContent = hi.toPrecision(3);
    svg.querySelector(".ymin").textContent = lo.toPrecision(3);
    svg.querySelector(".xmax").textContent = "step " + xs[xs.length - 1];
  }

  function addEvent(ev) {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.dateTime = ev.at;
    time.textContent = ev.at.slice(11, 19);  // UTC, as the rows the service rendered (HH:MM:SS)
    const action = document.createElement("strong");
    action.textContent = ev.action;
    const actor = document.createElement("span");
    actor.className = "actor";
    actor.textContent = ev.actor;
    const details = document.createElement("code");
    details.textContent = JSON.stringify(ev.details);
    li.append(time, " ", action, " ", actor, " ", details);
    document.getElementById("events").append(li);
  }

  function onEvent(ev) {
    const d = ev.details || {};
    if (ev.action === "run.step") {
      document.getElementById("step").textContent = d.step;
      document.getElementById("progress").value = d.step;
      if (d.metrics && typeof d.metrics.loss === "number") {
        series.loss.set(d.step, d.metrics.loss);
        draw("loss-chart", series.loss);
      }
    } else if (ev.action === "batch.received" && d.reward) {
      series.reward.set(d.rollout_step, d.reward.mean);
      document.getElementById("latest-reward").textContent = d.reward.mean.toFixed(3);
      draw("reward-chart", series.reward);
    } else if (["run.evicted", "run.completed", "run.failed", "run.deleted", "run.admitted"].includes(ev.action)) {
      const status = document.getElementById("status");
      status.textContent = ev.action.slice(4) === "admitted" ? "active" : ev.action.slice(4);
      status.className = "status status-" + status.textContent;
      if (ev.action === "run.deleted") hideCurves();
    }
    addEvent(ev);
  }

  // A deleted run's metrics are gone with it (the API answers them 404): its curves are hidden, as
  // the page the service renders for a deleted run hides them (templates/run.html).
  function hideCurves() {
    const charts = document.getElementById("charts");
    charts.hidden = true;
    charts.classList.remove("charts"); // its `display: grid` would override `hidden`
    series.reward.clear();
    series.loss.clear();
    document.getElementById("latest-reward").textContent = "\u2013";
    if (!document.getElementById("curves-deleted")) {
      const notice = document.createElement("p");
      notice.id = "curves-deleted";
      notice.textContent = "Deleted with the run: its metrics are no longer shown.";
      charts.before(notice);
    }
  }

  draw("reward-chart", series.reward);
  draw("loss-chart", series.loss);
  const actions = ["run.created", "run.queued", "run.admitted", "batch.received", "run.step", "adapter.published",
    "checkpoint.committed", "run.evicted", "run.completed", "run.failed", "run.deleted", "run.restart_from_checkpoint"];
  // The browser reconnects by itself after a dropped stream (with Last-Event-ID), but gives up for
  // good on a refusal: a 429 when the tenant has all its requests or streams in flight. So a closed
  // source is opened again here, after a growing pause, from the last event it delivered; unless the
  // run is gone or the session ended, which no retry mends: then the page says so and stops.
  const streamUrl = "/ui/runs/" + data.run_id + "/events";
  let cursor = data.cursor;
  let retryMs = 2000;
  let source = null;
  let stopped = false;

  function stop(message) {
    stopped = true;
    if (source) source.close();
    const notice = document.getElementById("gone");
    notice.textContent = message;
    notice.hidden = false;
  }

  function connect() {
    if (stopped) return;
    source = new EventSource(streamUrl + (cursor ? "?cursor=" + encodeURIComponent(cursor) : ""));
    for (const name of actions) {
      source.addEventListener(name, (msg) => {
        if (msg.lastEventId) cursor = msg.lastEventId;
        retryMs = 2000;
        const ev = JSON.parse(msg.data);
        onEvent(ev);
        // Nothing happens to a deleted run any more: its stream would only be polled (and opened
        // again by the browser whenever the server ends it) for as long as the page stays open.
        if (ev.action === "run.deleted") stop("This run was deleted.");
      });
    }
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED && !stopped) later();
    };
  }

  function later() {
    setTimeout(reconnect, retryMs);
    retryMs = Math.min(retryMs * 2, 60000);
  }

  // An EventSource cannot see why it was refused, so a plain request to its URL asks first. Its
  // cursor is not one: the route answers as it would answer the stream up to the cursor's check
  // (a 404 for a run that is gone, a redirect to the sign-in page for a session that ended, a 429
  // for a busy tenant) and then a 422, never a stream that would hold one of the tenant's stream
  // places (app/events/router.py start_of checks the cursor before the stream starts).
  async function reconnect() {
    let status = 0;
    try {
      const answer = await fetch(streamUrl + "?cursor=probe", {
        redirect: "manual", cache: "no-store", headers: { Accept: "application/json" },
      });
      status = answer.type === "opaqueredirect" ? 303 : answer.status;
    } catch (e) {
      status = 0;  // no answer (offline, the service restarting): try again later
    }
    if (status === 404) stop("This run no longer exists: it was deleted. Nothing more will happen here.");
    else if (status === 303 || status === 401) stop("You are signed out: sign in again to follow this run.");
    else if (status === 429 || status === 0 || status >= 500) later();
    else connect();
  }

  if (data.status === "deleted") stop("This run was deleted.");
  else connect();

  const form = document.getElementById("evict-form");
  if (form) {
    form.addEventListener("submit", (e) => {
      if (!window.confirm("Evict this run? It stops training and cannot be resumed.")) e.preventDefault();
    });
  }
})();
