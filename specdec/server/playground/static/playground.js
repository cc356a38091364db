// The playground's controls: builds OpenAI requests with the "speculative" extension (method, k,
// provenance), streams them into Run panels (run.js), stops them (aborting the fetch closes the
// connection, and the server cancels the request), and with "compare" decodes the same prompt with
// method none afterwards (one after the other, so the two do not share the machine) and shows both speeds.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;  // the AbortController of the request in flight

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function number(id, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const v = Number(raw);
  if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) {
    throw new Error(`${id.replace("_", " ")}: "${raw}" is not ${integer ? "an integer" : "a number"}`);
  }
  return v;
}

// The endpoint and body of one request; method undefined = the server's default.
function request(method) {
  const body = { stream: true, speculative: { provenance: true } };
  for (const [id, integer] of [["temperature", false], ["top_p", false], ["seed", true], ["max_tokens", true]]) {
    const v = number(id, integer);
    if (v !== undefined) body[id] = v;
  }
  if (method) body.speculative.method = method;
  const k = number("k", true);
  if (k !== undefined && method !== "none") body.speculative.num_speculative_tokens = k;
  const prompt = $("prompt").value;
  if ($("mode").value === "chat") {
    body.messages = [{ role: "user", content: prompt }];
    return ["/v1/chat/completions", body];
  }
  body.prompt = prompt;
  return ["/v1/completions", body];
}

async function errorMessage(response) {
  if (response.status === 401) {
    $("key-label").hidden = false;
    return "This server needs an API key: enter it above and generate again.";
  }
  try {
    return (await response.json()).error.message;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

// Streams one request into run's panel. Returns true when it finished, false when stopped or failed.
async function stream(run, method, label) {
  const [url, body] = request(method);
  run.panel.querySelector(".label").textContent = label;
  run.reset();
  controller = new AbortController();
  try {
    const response = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                         signal: controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    let failure = null;
    await readEvents(response, (ev) => {
      if (ev.error) { failure = ev.error.message; return; }
      if (ev.speculative && ev.choices.length) run.onFinal(ev.speculative);
      for (const choice of ev.choices) run.onChoice(choice);
    });
    if (failure) throw new Error(failure);
    run.setState("done");
    return true;
  } catch (e) {
    if (e.name === "AbortError") {
      run.setState("stopped");
    } else {
      run.setState("error");
      showError(e.message);
    }
    return false;
  } finally {
    controller = null;
    run.show();
  }
}

function compareLine(spec, plain) {
  const a = spec.figures().tps, b = plain.figures().tps;
  const speed = (v) => (v === null ? "–" : `${v.toFixed(1)} tok/s`);
  let line = `speculative ${speed(a)}, plain ${speed(b)}`;
  if (a !== null && b !== null && b > 0) line += `: ${(a / b).toFixed(2)}x`;
  const same = spec.text() === plain.text();
  line += same ? "; the texts are the same" : "; the texts differ";
  const seeded = $("seed").value.trim() !== "" || Number($("temperature").value) === 0;
  if (!same && seeded) line += " (greedy or seeded: expected the same up to near-ties of batched kernels)";
  return line;
}

const runs = {};

async function generate(event) {
  event.preventDefault();
  if (controller) return;
  showError("");
  $("comparison").hidden = true;
  const compare = $("compare").checked;
  $("run-plain").hidden = !compare;
  $("generate").disabled = true;
  $("stop").disabled = false;
  try {
    const method = $("method").value || undefined;
    request(method);  // checks the numbers before anything is sent
    const ok = await stream(runs.spec, method, method ? `method ${method}` : "server default method");
    if (ok && compare) {
      const plainOk = await stream(runs.plain, "none", "method none");
      if (plainOk) {
        $("comparison").textContent = compareLine(runs.spec, runs.plain);
        $("comparison").hidden = false;
      }
    }
  } catch (e) {
    showError(e.message);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

function stop() {
  if (controller) controller.abort();
}

async function showModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) $("key-label").hidden = false;
    if (r.ok) $("model").textContent = (await r.json()).data.map((m) => m.id).join(", ");
  } catch (e) {
    // the page still works; the first request will say what is wrong
  }
}

document.addEventListener("DOMContentLoaded", () => {
  runs.spec = new Run($("run-spec"));
  runs.plain = new Run($("run-plain"));
  for (const run of Object.values(runs)) run.setState("idle");
  $("form").addEventListener("submit", generate);
  $("stop").addEventListener("click", stop);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) $("form").requestSubmit();
  });
  showModel();
});
